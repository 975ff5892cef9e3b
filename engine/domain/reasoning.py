"""What a reply is made of when the model reasons: the channels its tokens go to, and how a model marks them.

A thinking model writes its reasoning before (or between) the parts a client
shows as the answer. How it marks the reasoning is the model's:

* :class:`ThinkFormat`: between a start and an end marker, each one token or a
  few (Qwen3 / Qwen3.5 / Qwen3-Next, GLM, DeepSeek, Kimi: ``<think>`` ...
  ``</think>``; Gemma 4: ``<|channel>thought`` ... ``<channel|>``). mlx-lm's
  tokenizer wrapper finds these (``think_start_tokens``/``think_end_tokens``).
* :class:`HarmonyFormat`: gpt-oss writes messages, each with a header naming its
  channel: ``analysis`` (reasoning), ``final`` (the answer), ``commentary``
  (a tool call when the header addresses ``to=functions.NAME``, else a preamble
  the user may see).

Every generated token goes to one :class:`Route`, or is markup that no client
sees (markers, harmony headers). Routes are decided on token ids as tokens are
chosen (``reasoning_tracker.py``), the one place that decides them: the engine
applies budgets and output grammars from the same decision the API splits the
text with.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Channel(str, enum.Enum):
    ANSWER = "answer"
    REASONING = "reasoning"
    CALL = "call"  # a tool call's arguments, written on a channel of their own (harmony's commentary to=functions.X)


@dataclass(frozen=True, slots=True)
class Route:
    """Where a generated token's text goes. For a call: which call of the turn (from 0) and the tool it names."""

    channel: Channel
    call: int = -1
    name: str = ""


ANSWER = Route(Channel.ANSWER)
REASONING = Route(Channel.REASONING)

@dataclass(frozen=True, slots=True)
class CallText:
    """Text of a tool call written on its own channel: the ``index``-th call of the turn, to tool ``name``."""

    index: int
    name: str
    text: str


@dataclass(frozen=True, slots=True)
class ThinkFormat:
    """Reasoning between ``start`` and ``end`` (token ids; the texts name them in messages and templates)."""

    start: tuple[int, ...]
    end: tuple[int, ...]
    start_text: str
    end_text: str

    def __post_init__(self) -> None:
        if not self.start or not self.end:
            raise ValueError("a think format needs a start and an end marker of at least one token")

    @property
    def name(self) -> str:
        return f"{self.start_text} ... {self.end_text}"


@dataclass(frozen=True, slots=True)
class HarmonyFormat:
    """gpt-oss's message markup: the special tokens' ids, and the ids of the words a forced header is made of."""

    start: int  # <|start|>
    end: int  # <|end|>
    message: int  # <|message|>
    channel: int  # <|channel|>
    call: int  # <|call|> (ends a tool call, and the turn)
    return_: int  # <|return|> (ends the final answer, and the turn)
    assistant: tuple[int, ...]  # the role's tokens after <|start|>
    analysis: tuple[int, ...]  # the reasoning channel's name

    @property
    def name(self) -> str:
        return "harmony (analysis / commentary / final channels)"

    @property
    def markup(self) -> frozenset[int]:
        return frozenset((self.start, self.end, self.message, self.channel, self.call, self.return_))


ReasoningFormat = ThinkFormat | HarmonyFormat


@dataclass(frozen=True, slots=True)
class TokenRule:
    """What the next token must be, when the reasoning decides it: ``force`` is the only token allowed; else
    the tokens in ``forbid`` are not allowed. (A budget spent writes the end of the reasoning this way.)"""

    force: int | None = None
    forbid: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ReasoningRequest:
    """What a turn asks of the model's reasoning: ``budget`` tokens at most (None: no limit but max_tokens;
    0: none, the end marker is written at once if the prompt opened the reasoning)."""

    budget: int | None = None

    def __post_init__(self) -> None:
        if self.budget is not None and self.budget < 0:
            raise ValueError(f"a reasoning budget must be >= 0, got {self.budget}")
