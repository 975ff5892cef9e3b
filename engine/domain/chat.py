"""The conversation both protocols are translated into before rendering."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: Role
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None  # tool name, for tool results
    # An assistant turn's reasoning, as a thinking model wrote it (markers left out); the chat template decides
    # whether it renders (api/rendering.py).
    reasoning: str = ""


@dataclass(frozen=True, slots=True)
class ToolSpec:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    # Calls must follow ``parameters`` exactly (Anthropic's and OpenAI's ``strict``): decoding is constrained to it.
    strict: bool = False


@dataclass(frozen=True, slots=True)
class Conversation:
    messages: tuple[ChatMessage, ...]
    tools: tuple[ToolSpec, ...] = ()
    # "auto", "any" (must call some tool), "none", or a tool name.
    tool_choice: str = "auto"
    # False: at most one call a reply (Anthropic's disable_parallel_tool_use, OpenAI's parallel_tool_calls);
    # enforced when the reply is constrained (strict tools, a forced choice: api/tool_constraints.py).
    parallel_tool_calls: bool = True
    # Keyword arguments for the chat template (``enable_thinking``, a client's ``chat_template_kwargs``), as
    # sorted pairs so the conversation stays hashable.
    template_kwargs: tuple[tuple[str, Any], ...] = ()

    def system_text(self) -> str:
        return "\n\n".join(m.content for m in self.messages if m.role == "system")

    def head(self) -> "Conversation | None":
        """The leading system messages and the tools: what every session of one tool starts with."""
        leading = []
        for message in self.messages:
            if message.role != "system":
                break
            leading.append(message)
        if not leading and not self.tools:
            return None
        return Conversation(tuple(leading), self.tools, self.tool_choice, template_kwargs=self.template_kwargs)
