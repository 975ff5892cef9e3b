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
class ImagePart:
    """An image a client sent in a message: its encoded bytes (PNG, JPEG, GIF, WebP), or a URL when the
    server may fetch images (``data`` empty until fetched). ``field`` names where it was in the request."""

    data: bytes
    media_type: str = ""
    field: str = ""
    url: str = ""

    def __repr__(self) -> str:  # (conversations are hashed by repr: the bytes' digest stands for them)
        from engine.domain.images import image_digest

        return f"ImagePart({image_digest(self.data)[:16] if self.data else self.url!r}, {len(self.data)} B)"


# A message's content in order when it holds images: text pieces and images.
Part = str | ImagePart


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: Role
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None  # tool name, for tool results
    # An assistant turn's reasoning, as a thinking model wrote it (markers left out); the chat template decides
    # whether it renders (engine/formats/rendering.py).
    reasoning: str = ""
    # The content in order, images included, when the message holds images (``content`` is then its text with a
    # placeholder for each image: what a model without vision is shown when the server allows that). Empty: none.
    parts: tuple[Part, ...] = ()

    @property
    def images(self) -> tuple[ImagePart, ...]:
        return tuple(part for part in self.parts if isinstance(part, ImagePart))


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
    # enforced when the reply is constrained (strict tools, a forced choice: engine/formats/tools/constraints.py).
    parallel_tool_calls: bool = True
    # Keyword arguments for the chat template (``enable_thinking``, a client's ``chat_template_kwargs``), as
    # sorted pairs so the conversation stays hashable.
    template_kwargs: tuple[tuple[str, Any], ...] = ()

    @property
    def images(self) -> tuple[ImagePart, ...]:
        return tuple(image for message in self.messages for image in message.images)

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
