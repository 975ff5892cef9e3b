"""The scrolling transcript of one chat pane: messages, request lines, usage, errors."""

from __future__ import annotations

from typing import TypeVar

from textual.containers import VerticalScroll
from textual.widgets import Markdown, Static
from textual.widgets.markdown import MarkdownStream

from .reasoning_fold import ReasoningFold

W = TypeVar("W", Markdown, Static, ReasoningFold)
# About 30 turns (message, reply, usage line each) stay on screen.
MAX_WIDGETS = 90


class ChatTranscript(VerticalScroll):
    """One Markdown widget per message; notes about a turn are one-line Statics under it."""

    DEFAULT_CSS = """
    ChatTranscript {
        height: 1fr;
        padding: 0 1;
        scrollbar-size-vertical: 1;
    }
    ChatTranscript > Markdown { padding: 0 1; margin: 0; }
    /* A paragraph's bottom margin separates blocks; after a message's last block it is just a gap. */
    ChatTranscript > Markdown > MarkdownBlock:last-child { margin-bottom: 0; }
    ChatTranscript > Markdown.chat-user {
        margin-top: 1;
        background: $boost;
        border-left: outer $accent;
    }
    ChatTranscript > Markdown.chat-assistant { margin-top: 1; }
    ChatTranscript > Static { padding: 0 1; }
    ChatTranscript > .chat-usage { color: $text-muted; }
    ChatTranscript > .chat-image { color: $text-accent; }
    ChatTranscript > .chat-request { color: $text-muted; text-style: italic; margin-top: 1; }
    ChatTranscript > .chat-note { color: $text-warning; }
    ChatTranscript > .chat-error { color: $text-error; text-style: bold; }
    ChatTranscript.-compact { padding: 0; }
    ChatTranscript.-compact > Markdown, ChatTranscript.-compact > Static { padding: 0; }
    """

    def on_mount(self) -> None:
        # Follow the newest text while the user has not scrolled away from the bottom.
        self.anchor()

    async def add_user(self, text: str) -> Markdown:
        return await self._add(Markdown(text, classes="chat-user"))

    async def start_reply(self) -> tuple[Markdown, MarkdownStream]:
        reply = await self._add(Markdown(classes="chat-assistant"))
        return reply, Markdown.get_stream(reply)

    async def start_reasoning(self) -> ReasoningFold:
        return await self._add(ReasoningFold())

    async def add_request(self, text: str) -> None:
        await self._add(Static(text, classes="chat-request", markup=False))

    async def add_usage(self, text: str) -> None:
        await self._add(Static(text, classes="chat-usage", markup=False))

    async def add_image(self, text: str) -> None:
        """One line standing for an image the message carries (image_attachments.Attachment.line)."""
        await self._add(Static(f"▣ {text}", classes="chat-image", markup=False))

    async def add_note(self, text: str) -> None:
        await self._add(Static(text, classes="chat-note", markup=False))

    async def add_error(self, text: str) -> None:
        await self._add(Static(text, classes="chat-error", markup=False))

    def plain_text(self) -> str:
        """Everything the transcript shows, as text (tests, copying)."""
        parts = []
        for child in self.children:
            if isinstance(child, ReasoningFold):
                parts.append(f"[{child.title}]")
            elif isinstance(child, Markdown):
                parts.append(child.source)
            elif isinstance(child, Static):
                parts.append(str(child.render()))
        return "\n".join(parts)

    async def _add(self, widget: W) -> W:
        await self.mount(widget)
        await self._trim()
        return widget

    async def _trim(self) -> None:
        """Keep the newest widgets only: every re-layout walks them all, so an
        unbounded transcript would slow the whole screen down over a long
        session. The pane's history (what the model sees) is not affected."""
        excess = len(self.children) - MAX_WIDGETS
        if excess > 0:
            await self.remove_children(list(self.children[:excess]))


class LiveReply:
    """The assistant Markdown of one turn, created with its first text so errors leave no blank block; a thinking
    model's reasoning goes in a fold above it (reasoning_fold.py)."""

    def __init__(self, transcript: ChatTranscript) -> None:
        self.transcript = transcript
        self.text = ""
        self.reasoning = ""
        self.announced = False  # watch mode: the request line is shown
        self._stream: MarkdownStream | None = None
        self._fold: ReasoningFold | None = None

    async def think(self, text: str, tokens: int) -> None:
        if self._stream is not None:  # reasoning after answer text: a fold of its own, below it
            await self._stream.stop()
            self._stream = None
            self._end_fold()
            self._fold = None
        if self._fold is None:
            self._fold = await self.transcript.start_reasoning()
        self.reasoning += text
        self._fold.add(text, tokens)

    async def write(self, text: str) -> None:
        if self._stream is None:
            self._end_fold()
            _, self._stream = await self.transcript.start_reply()
        self.text += text
        await self._stream.write(text)

    async def close(self, reasoning_tokens: int | None = None) -> None:
        self._end_fold(reasoning_tokens)
        if self._stream is not None:
            await self._stream.stop()

    def _end_fold(self, tokens: int | None = None) -> None:
        if self._fold is not None:
            self._fold.done(tokens)
