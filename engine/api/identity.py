"""Which agent a request belongs to (protocol.md, "Which agent a request belongs to").

1. Claude Code's ``X-Claude-Code-Session-Id`` (a subagent's
   ``x-claude-code-agent-id`` makes a separate agent, of class subagent, grouped
   under the session with its ``x-claude-code-parent-agent-id``);
2. OpenAI ``session_id`` / ``X-Session-Id``; the direct API's URL id;
3. ``metadata.user_id`` when it carries a session id;
4. a hash of the canonical prompt prefix (tools + system, attribution
   blocks stripped) — never of the first user message, where Claude Code
   puts CLAUDE.md, so all sessions of a project would collide.

Within one session the agent id also carries a short hash of that canonical
prefix: Claude Code's side requests (titles, classifiers) use other system
prompts, so they become their own small agents and can never trim or evict
the main conversation's cache.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, replace
from typing import Any, Mapping

from engine.domain.chat import Conversation
from engine.domain.priority import AgentClass, Lineage, parse_class
from engine.domain.requests import AgentSource
from engine.errors import InvalidRequestError
from engine.formats.rendering import dumps

SESSION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,95}$")
AUX_MAX_TOKENS = 32


@dataclass(frozen=True, slots=True)
class AgentIdentity:
    agent_id: str
    source: AgentSource
    display_name: str
    auxiliary: bool = False
    # Named by a hash of the prompt's prefix, not by the client: concurrent requests take sibling lanes
    # (agent_lanes.py) instead of waiting for one another.
    derived: bool = False
    # Who it is to the person at the machine (domain/priority.py), and the session its agents group under.
    agent_class: AgentClass = AgentClass.MAIN
    lineage: Lineage = Lineage()


def _session(value: str | None, field: str) -> str | None:
    if value is None or value == "":
        return None
    if not SESSION_ID.match(value):
        raise InvalidRequestError(f"{field} must be 1-96 characters of letters, digits, _ and -", field=field)
    return value


def prefix_hash(conversation: Conversation) -> str:
    canonical = {
        "system": conversation.system_text(),
        "tools": [{"name": t.name, "description": t.description, "parameters": t.parameters} for t in conversation.tools],
    }
    return hashlib.sha256(dumps(canonical).encode()).hexdigest()[:16]


def session_from_user_id(user_id: Any) -> str | None:
    """Newer Claude Code sends JSON with a session_id; older ones ``..._session_<uuid>``."""
    if not isinstance(user_id, str) or not user_id:
        return None
    try:
        data = json.loads(user_id)
        if isinstance(data, dict) and isinstance(data.get("session_id"), str):
            return _clean(data["session_id"])
    except ValueError:
        pass
    match = re.search(r"session_([A-Za-z0-9-]{8,})", user_id)
    return _clean(match.group(1)) if match else None


def _clean(value: str) -> str | None:
    return value if SESSION_ID.match(value) else None


def is_auxiliary(max_tokens: int, model: str | None) -> bool:
    """Claude Code's side requests: tiny probes, and titles/classifiers on its small model."""
    return max_tokens <= AUX_MAX_TOKENS or "haiku" in (model or "").lower()


def anthropic_identity(
    headers: Mapping[str, str], conversation: Conversation, metadata: Mapping[str, Any] | None,
    max_tokens: int, model: str | None,
) -> AgentIdentity:
    aux = is_auxiliary(max_tokens, model)
    prefix = prefix_hash(conversation)
    session = _session(headers.get("x-claude-code-session-id"), "X-Claude-Code-Session-Id")
    if session is not None:
        sub = _session(headers.get("x-claude-code-agent-id"), "x-claude-code-agent-id")
        base = f"cc-{session}" + (f"-sub-{sub}" if sub else "")
        label = f"Claude Code {session[:8]}" + (f" / subagent {sub[:8]}" if sub else "")
        role = AgentClass.SIDE if aux else AgentClass.SUBAGENT if sub else AgentClass.MAIN
        # A subagent's spawner (Claude Code 2.1.139 and later): another subagent's id, or none for the main agent.
        parent = _clean(headers.get("x-claude-code-parent-agent-id", "")) if sub else None
        return AgentIdentity(f"{base}-{prefix[:8]}", AgentSource.CLAUDE_CODE, _labelled(label, aux), aux,
                             agent_class=role, lineage=Lineage(f"cc-{session}", parent))
    meta_session = session_from_user_id((metadata or {}).get("user_id"))
    if meta_session is not None:
        return AgentIdentity(f"cc-{meta_session}-{prefix[:8]}", AgentSource.CLAUDE_CODE,
                             _labelled(f"Claude Code {meta_session[:8]}", aux), aux,
                             agent_class=AgentClass.SIDE if aux else AgentClass.MAIN,
                             lineage=Lineage(f"cc-{meta_session}"))
    return AgentIdentity(f"anthropic-{prefix}", AgentSource.ANTHROPIC, f"Anthropic client {prefix[:8]}", aux,
                         derived=True, agent_class=AgentClass.SIDE if aux else AgentClass.MAIN)


def openai_identity(headers: Mapping[str, str], body_session: str | None, conversation: Conversation) -> AgentIdentity:
    named = _openai_session(headers, body_session)
    if named is not None:
        return named
    prefix = prefix_hash(conversation)
    return AgentIdentity(f"openai-{prefix}", AgentSource.OPENAI, f"OpenAI client {prefix[:8]}", derived=True)


def completions_identity(headers: Mapping[str, str], body_session: str | None) -> AgentIdentity:
    """A text completion's agent: its ``session_id`` (or ``X-Session-Id``) as on chat completions; without one, one
    agent for every such client, whose concurrent requests take sibling lanes (agent_lanes.py), each lane reusing
    what its last prompt shares with the next. (A raw prompt has no system prompt or tools to name it by.)"""
    named = _openai_session(headers, body_session)
    return named or AgentIdentity("completions", AgentSource.OPENAI, "Completions client", derived=True)


def _openai_session(headers: Mapping[str, str], body_session: str | None) -> AgentIdentity | None:
    """The agent an OpenAI request names: its body's ``session_id``, else ``X-Session-Id``; None: it names none."""
    session = _session(body_session, "session_id") or _session(headers.get("x-session-id"), "X-Session-Id")
    if session is None:
        return None
    return AgentIdentity(f"oa-{session}", AgentSource.OPENAI, f"OpenAI session {session[:24]}")


def responses_identity(
    headers: Mapping[str, str], prompt_cache_key: str | None, conversation: Conversation,
) -> AgentIdentity:
    """The agent of a Responses API turn that continues no stored response.

    Codex CLI sends ``store: false`` and its whole history every turn, with its
    thread id as ``prompt_cache_key``: that id is the agent, so each turn finds
    the cache of the one before. Other clients' keys name their agent the
    same way (a key that is not a plain id is hashed); without a key, the
    canonical prefix does, as for chat completions.
    """
    codex = is_codex(headers)
    source = AgentSource.CODEX if codex else AgentSource.OPENAI
    if prompt_cache_key:
        key = _clean(prompt_cache_key) or hashlib.sha256(prompt_cache_key.encode()).hexdigest()[:16]
        if codex:
            return codex_thread(AgentIdentity(f"codex-{key}", source, f"Codex {key[:8]}"), headers, key)
        return AgentIdentity(f"rs-{key}", source, f"Responses client {key[:24]}")
    prefix = prefix_hash(conversation)
    if codex:
        return codex_thread(AgentIdentity(f"codex-{prefix}", source, f"Codex {prefix[:8]}", derived=True),
                            headers, prefix)
    return AgentIdentity(f"responses-{prefix}", source, f"Responses client {prefix[:8]}", derived=True)


def codex_thread(identity: AgentIdentity, headers: Mapping[str, str], thread: str) -> AgentIdentity:
    """A Codex thread's place: a spawned sub-thread names its parent (``x-codex-parent-thread-id``, with
    ``x-openai-subagent``) and groups under it; any other thread is a main agent of its own."""
    parent = _clean(headers.get("x-codex-parent-thread-id", ""))
    if parent is not None or headers.get("x-openai-subagent"):
        family = f"codex-{parent}" if parent else None
        return replace(identity, agent_class=AgentClass.SUBAGENT, lineage=Lineage(family, family),
                       display_name=f"{identity.display_name} / subagent")
    return replace(identity, lineage=Lineage(f"codex-{thread}"))


AGENT_CLASS_HEADER, AGENT_NAME_HEADER = "x-semantic-agent-class", "x-semantic-agent-name"


def with_client_hints(identity: AgentIdentity, headers: Mapping[str, str]) -> AgentIdentity:
    """What a client says of itself beyond its protocol (``semantic launch --name``, a script that is background
    work): ``x-semantic-agent-name`` names the agent in the workbench, ``x-semantic-agent-class`` sets its class."""
    name = headers.get(AGENT_NAME_HEADER, "").strip()
    wanted = headers.get(AGENT_CLASS_HEADER, "").strip()
    if name:
        if len(name) > 64 or not name.isprintable():
            raise InvalidRequestError(f"{AGENT_NAME_HEADER} must be 1-64 printable characters",
                                      field=AGENT_NAME_HEADER)
        suffix = identity.display_name.partition(" / ")[2]
        named = f"{name} / {suffix}" if suffix else name
        identity = replace(identity, display_name=_labelled(named, identity.auxiliary and not suffix))
    if wanted and not identity.auxiliary:
        try:
            identity = replace(identity, agent_class=parse_class(wanted, AGENT_CLASS_HEADER))
        except ValueError as exc:
            raise InvalidRequestError(str(exc), field=AGENT_CLASS_HEADER) from None
    return identity


def is_codex(headers: Mapping[str, str]) -> bool:
    """Codex CLI names itself in ``originator`` (codex_exec, codex_cli_rs) and its user agent."""
    return (headers.get("originator", "").startswith("codex")
            or headers.get("user-agent", "").lower().startswith("codex"))


def _labelled(label: str, auxiliary: bool) -> str:
    return f"{label} (side request)" if auxiliary else label
