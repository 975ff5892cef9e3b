"""The ``model`` a Messages reply names: the request's, marked for the 1M-context beta when asked.

Claude Code keeps the ``model`` of every reply in its session transcript and,
on ``--continue`` or ``--resume``, restores that model. It asks for its
default Opus as ``model: "claude-opus-4-8"`` plus the ``context-1m-*`` beta,
and its system prompt and Bash tool name the variant ("Opus 4.8 (1M context)",
"claude-opus-4-8[1m]"). Restored as plain ``claude-opus-4-8``, a continued
session runs the 200K-context variant, whose system prompt differs about a
thousand tokens in: its next request would share almost nothing with the
cache its own first turn built. Naming the variant Claude Code asked for
(``[1m]``, its own spelling) keeps a continued session's prompt identical.
Measured with the real CLI (tests/model/test_claude_code_full_real.py).
"""

from __future__ import annotations

from typing import Mapping

ONE_MILLION_SUFFIX = "[1m]"
ONE_MILLION_BETA = "context-1m-"


def reply_model(requested: str, headers: Mapping[str, str]) -> str:
    betas = [b.strip() for b in headers.get("anthropic-beta", "").split(",")]
    asked_1m = any(b.startswith(ONE_MILLION_BETA) for b in betas)
    if asked_1m and requested and not requested.lower().endswith(ONE_MILLION_SUFFIX):
        return requested + ONE_MILLION_SUFFIX
    return requested
