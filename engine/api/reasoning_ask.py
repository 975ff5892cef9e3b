"""What each protocol's request says about reasoning, as one neutral :class:`ReasoningAsk`.

* Anthropic ``thinking``: ``{"type": "disabled"}`` renders the template's
  no-thinking form; ``{"type": "enabled", "budget_tokens": N}`` (N below
  ``max_tokens``) caps the reasoning at N tokens; ``{"type": "adaptive"}``
  takes its budget from ``output_config.effort`` (Anthropic's default effort,
  ``high``, when none is named). ``display: "omitted"`` returns thinking
  blocks with empty text (their signature still carries it). Absent: the
  model reasons as its template does by default, without a budget.
  ``context_management``'s ``clear_thinking`` edit with ``keep: "all"`` (what
  Claude Code sends) keeps earlier reasoning in the prompt where the template
  has a switch for it (``KEEP_REASONING``); Qwen's templates have none and
  drop it before the last user message.
* OpenAI chat completions: ``reasoning_effort`` (``none`` turns reasoning
  off) and ``chat_template_kwargs`` (passed to the template as they are, e.g.
  ``{"enable_thinking": false}``).
* Responses: ``reasoning.effort`` (``none`` turns it off).

One mapping from effort to a budget serves all three (``EFFORT_BUDGETS``):
``minimal`` 256 tokens, ``low`` 1,024, ``medium`` 4,096, ``high`` 16,384;
``xhigh`` and ``max`` set no budget (only ``max_tokens`` ends the reasoning).
A budget from an effort is held to three quarters of the request's
``max_tokens`` (a short side request asking ``medium`` still gets an answer);
an explicit ``budget_tokens`` must be below ``max_tokens``.
A budget is exact: the engine writes the end-of-reasoning marker after that
many reasoning tokens (domain/reasoning_tracker.py). When the server's
``max_output_tokens`` clamps a reply, the budget is held to three quarters of
what is left, so the answer still has room (domain/requests.clamped).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequestError

EFFORT_BUDGETS: dict[str, int | None] = {"minimal": 256, "low": 1024, "medium": 4096, "high": 16384,
                                         "xhigh": None, "max": None}
OFF = "none"
# Anthropic's documented default effort for adaptive thinking.
ANTHROPIC_DEFAULT_EFFORT = "high"
THINKING_TYPES = ("enabled", "disabled", "adaptive")
DISPLAYS = ("summarized", "omitted")


@dataclass(frozen=True, slots=True)
class ReasoningAsk:
    # False: the template's no-thinking form (``enable_thinking=False``) and no reasoning tokens; None: its default.
    enabled: bool | None = None
    budget: int | None = None  # at most this many reasoning tokens (None: no limit but max_tokens)
    omitted: bool = False  # Anthropic's display "omitted": thinking text withheld, the signature still carries it
    template_kwargs: tuple[tuple[str, Any], ...] = ()  # a client's chat_template_kwargs

    @property
    def engine_budget(self) -> int | None:
        return 0 if self.enabled is False else self.budget

    def kwargs(self) -> tuple[tuple[str, Any], ...]:
        """The chat template's keyword arguments: the client's own, and ``enable_thinking`` when turned off."""
        given = dict(self.template_kwargs)
        if self.enabled is False:
            given.setdefault("enable_thinking", False)
        return tuple(sorted(given.items()))


DEFAULT = ReasoningAsk()
DISABLED = ReasoningAsk(enabled=False, budget=0)


def from_effort(effort: Any, field: str, max_tokens: int) -> ReasoningAsk:
    if effort is None:
        return DEFAULT
    if effort == OFF:
        return DISABLED
    if not isinstance(effort, str) or effort not in EFFORT_BUDGETS:
        names = ", ".join([OFF, *EFFORT_BUDGETS])
        raise InvalidRequestError(f"{field} must be one of {names}; got {effort!r}", field=field)
    budget = EFFORT_BUDGETS[effort]
    if budget is not None:
        budget = min(budget, max_tokens - max(1, max_tokens // 4))
    return ReasoningAsk(budget=budget)


# Templates' own switches for keeping earlier reasoning in the prompt (GLM-4.7: clear_thinking; Gemma 4:
# preserve_thinking); a template without one ignores them.
KEEP_REASONING = (("clear_thinking", False), ("preserve_thinking", True))


def keeps_all_thinking(context_management: Any) -> bool:
    """Anthropic's ``context_management`` asks to keep every earlier thinking block (Claude Code sends
    ``{"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}``)."""
    edits = context_management.get("edits") if isinstance(context_management, dict) else None
    return any(isinstance(e, dict) and str(e.get("type", "")).startswith("clear_thinking") and e.get("keep") == "all"
               for e in edits or ())


def anthropic_reasoning(thinking: dict[str, Any] | None, output_config: dict[str, Any] | None,
                        max_tokens: int, context_management: Any = None) -> ReasoningAsk:
    asked = _anthropic_thinking(thinking, output_config, max_tokens)
    if not keeps_all_thinking(context_management):
        return asked
    return ReasoningAsk(asked.enabled, asked.budget, asked.omitted, tuple(sorted(KEEP_REASONING)))


def _anthropic_thinking(thinking: dict[str, Any] | None, output_config: dict[str, Any] | None,
                        max_tokens: int) -> ReasoningAsk:
    if thinking is None:
        return DEFAULT
    kind = thinking.get("type")
    if kind not in THINKING_TYPES:
        raise InvalidRequestError(f"thinking.type must be one of {', '.join(THINKING_TYPES)}; got {kind!r}",
                                  field="thinking.type")
    display = thinking.get("display", "summarized")
    if display not in DISPLAYS:
        raise InvalidRequestError(f"thinking.display must be one of {', '.join(DISPLAYS)}; got {display!r}",
                                  field="thinking.display")
    if kind == "disabled":
        return DISABLED
    omitted = display == "omitted"
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise InvalidRequestError("thinking.budget_tokens must be a positive integer when thinking is enabled",
                                      field="thinking.budget_tokens")
        if budget >= max_tokens:
            raise InvalidRequestError(f"thinking.budget_tokens ({budget}) must be less than max_tokens ({max_tokens})",
                                      field="thinking.budget_tokens")
        return ReasoningAsk(True, budget, omitted)
    effort = (output_config or {}).get("effort", ANTHROPIC_DEFAULT_EFFORT)
    asked = from_effort(effort, "output_config.effort", max_tokens)
    return ReasoningAsk(asked.enabled, asked.budget, omitted)


def openai_reasoning(effort: Any, template_kwargs: dict[str, Any] | None, max_tokens: int) -> ReasoningAsk:
    asked = from_effort(effort, "reasoning_effort", max_tokens)
    if template_kwargs is None:
        return asked
    if not isinstance(template_kwargs, dict):
        raise InvalidRequestError("chat_template_kwargs must be an object", field="chat_template_kwargs")
    pairs = tuple(sorted(template_kwargs.items()))
    enabled = asked.enabled
    if template_kwargs.get("enable_thinking") is False:
        enabled = False
    return ReasoningAsk(enabled, 0 if enabled is False else asked.budget, template_kwargs=pairs)


def responses_reasoning(reasoning: Any, max_tokens: int) -> ReasoningAsk:
    if reasoning is None:
        return DEFAULT
    if not isinstance(reasoning, dict):
        raise InvalidRequestError("reasoning must be an object such as {\"effort\": \"medium\"}", field="reasoning")
    return from_effort(reasoning.get("effort"), "reasoning.effort", max_tokens)
