"""A thinking model's reasoning in a chat transcript: folded, dimmed, with its token count in the title.

Folded by default (the answer is what the user reads; the reasoning is a
keypress away, Enter on the title). The text grows as the reasoning streams
in batches; the count is of tokens that carried reasoning, and the turn's
usage makes it exact at the end.
"""

from __future__ import annotations

from textual.widgets import Collapsible, Static


def fold_title(tokens: int, done: bool) -> str:
    return f"thought · {tokens:,} tokens" if done else f"thinking… {tokens:,} tokens"


class ReasoningFold(Collapsible):
    DEFAULT_CSS = """
    ReasoningFold { margin: 1 0 0 0; padding: 0; border: none; background: transparent; }
    ReasoningFold > CollapsibleTitle { color: $text-muted; text-style: italic; padding: 0 1; }
    ReasoningFold > Contents { padding: 0 1 0 3; }
    ReasoningFold .reasoning-text { color: $text-muted; text-style: dim; }
    """

    def __init__(self) -> None:
        self.text = ""
        self.tokens = 0
        self._body = Static("", classes="reasoning-text", markup=False)
        super().__init__(self._body, title=fold_title(0, False), collapsed=True, classes="chat-reasoning")

    def add(self, text: str, tokens: int) -> None:
        self.text += text
        self.tokens += tokens
        self._body.update(self.text)
        self.title = fold_title(self.tokens, False)

    def done(self, tokens: int | None = None) -> None:
        """The reasoning ended; ``tokens``: the exact count, from the turn's usage."""
        if tokens is not None:
            self.tokens = tokens
        self.title = fold_title(self.tokens, True)
