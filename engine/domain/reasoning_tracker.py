"""Which route each generated token takes, decided as tokens are chosen; and what a reasoning budget forces.

One tracker per turn of a thinking model. ``feed`` takes every token the turn
chooses, in order, and returns the tokens whose route is now decided, each
with its route; markup (markers, harmony headers) is never returned, so it
never reaches a client's text. A marker several tokens long is held back
until it is whole or cannot be; tokens held that turn out not to be one go
to the route they were written in. The turn starts where its prompt left
off: a prompt whose template opened the reasoning (``<think>\n`` in the
generation prompt) starts in reasoning.

A budget is exact: after ``budget`` reasoning tokens the tracker's ``rule``
forces the end marker (for harmony: the end of the message and a new
header, whose channel may then be anything but ``analysis``), and once
spent the reasoning cannot be opened again in that turn. ``may_rule`` tells
the batch ahead of time (it launches a step before reading the token in
flight) whether the next token may be ruled, so turns without a budget, or
far from it, are never masked.
"""

from __future__ import annotations

import re
from collections import deque
from typing import Callable, Sequence

from engine.domain.reasoning import (
    ANSWER,
    REASONING,
    Channel,
    HarmonyFormat,
    ReasoningFormat,
    Route,
    ThinkFormat,
    TokenRule,
)

Routed = list[tuple[int, Route]]
# A prompt whose last few tokens close the reasoning had it closed by its template (thinking turned off).
CLOSED_BY_TEMPLATE = 8
# A harmony header is a few tokens; one that runs past this is text the model wrote outside the markup.
HEADER_LIMIT = 64


def find_last(tokens: Sequence[int], marker: Sequence[int]) -> int:
    """Index of the last occurrence of ``marker`` in ``tokens``; -1 when there is none."""
    n = len(marker)
    for at in range(len(tokens) - n, -1, -1):
        if tokens[at] == marker[0] and list(tokens[at:at + n]) == list(marker):
            return at
    return -1


def opened_at(fmt: ReasoningFormat | None, prompt: Sequence[int]) -> int:
    """Where the prompt's generation prompt opened the reasoning (its start marker among the last few tokens, not
    closed after it): the reply begins there as a later prompt renders it. 0: it did not."""
    if not isinstance(fmt, ThinkFormat):
        return 0
    opened = find_last(prompt, fmt.start)
    if opened < max(1, len(prompt) - CLOSED_BY_TEMPLATE) or find_last(prompt, fmt.end) > opened:
        return 0
    return opened


def _held_suffix(held: list[int], marker: Sequence[int]) -> int:
    """Length of the longest suffix of ``held`` that is a proper prefix of ``marker``."""
    for n in range(min(len(held), len(marker) - 1), 0, -1):
        if held[-n:] == list(marker[:n]):
            return n
    return 0


class _Budget:
    """Reasoning tokens counted against an optional budget, and the tokens it forces once spent."""

    def __init__(self, budget: int | None) -> None:
        self.budget = budget
        self.reasoning_tokens = 0
        self.forced: deque[int] = deque()
        self.spent = budget is not None and budget <= 0

    def fed(self, token: int) -> None:
        """A chosen token: the next forced one goes, or the force is over (a stop token ended the turn)."""
        if self.forced and self.forced[0] == token:
            self.forced.popleft()
        else:
            self.forced.clear()

    def near(self, pending: int) -> bool:
        """The budget is spent, or will be within ``pending`` more reasoning tokens."""
        return self.budget is not None and self.reasoning_tokens + pending >= self.budget

    def room(self, held: int, unlimited: int) -> int:
        """How many tokens may be chosen unruled from here (drafts verified at once): none while forcing or once
        spent, else as many as cannot reach the budget."""
        if self.forced or self.spent:
            return 0
        if self.budget is None:
            return unlimited
        return max(0, self.budget - self.reasoning_tokens - held - 1)


class _Tracker:
    """What both formats' trackers keep: the reasoning tokens counted against the budget."""

    _budget: _Budget

    @property
    def reasoning_tokens(self) -> int:
        return self._budget.reasoning_tokens


class ThinkTracker(_Tracker):
    def __init__(self, fmt: ThinkFormat, prompt: Sequence[int], budget: int | None = None,
                 constrained: bool = False) -> None:
        self.fmt = fmt
        opened, closed = find_last(prompt, fmt.start), find_last(prompt, fmt.end)
        self.route = REASONING if opened > closed else ANSWER
        # Thinking turned off by the template (an empty block closed at the prompt's end): no opening then.
        self.closed_by_template = opened <= closed and closed >= 0 and closed >= len(prompt) - CLOSED_BY_TEMPLATE
        self.constrained = constrained  # an output grammar applies to the answer (the tracker forces markers whole)
        self.generated = 0
        self._budget = _Budget(budget)
        self._held: list[int] = []
        self._check_budget()

    @property
    def answering(self) -> bool:
        """The next token, if it is text, is the answer's (an output grammar applies to it)."""
        return self.route is ANSWER and not self._held

    @property
    def opening_token(self) -> int | None:
        """The token that may open the reasoning as the reply's first, beside what a grammar allows."""
        if (self.generated or self.route is not ANSWER or self.closed_by_template or self._budget.spent
                or self._budget.budget == 0):
            return None
        return self.fmt.start[0]

    def feed(self, token: int) -> Routed:
        self.generated += 1
        self._budget.fed(token)
        marker = self._marker()
        held = self._held + [token]
        if held == list(marker[:len(held)]):
            if len(held) == len(marker):
                self._held = []
                self.route = ANSWER if self.route is REASONING else REASONING
                if self.route is ANSWER and self._budget.near(0):
                    self._budget.spent = True
            else:
                self._held = held
            self._check_budget()
            return []
        keep = _held_suffix(held, marker)
        released, self._held = held[:len(held) - keep], held[len(held) - keep:]
        if self.route is REASONING:
            self._budget.reasoning_tokens += len(released)
        self._check_budget()
        return [(t, self.route) for t in released]

    def flush(self) -> Routed:
        """The turn is over: tokens held as a possible marker are the text they were written in."""
        held, self._held = self._held, []
        if self.route is REASONING:
            self._budget.reasoning_tokens += len(held)
        return [(t, self.route) for t in held]

    def rule(self) -> TokenRule | None:
        if self._budget.forced:
            return TokenRule(force=self._budget.forced[0])
        if self._held and self.constrained and self.route is ANSWER:
            return TokenRule(force=self.fmt.start[len(self._held)])  # an opening a grammar let in goes whole
        if self._budget.spent and self.route is ANSWER and not self._held:
            return TokenRule(forbid=(self.fmt.start[0],))
        return None

    def may_rule(self, in_flight: int = 1) -> bool:
        """Whether ``rule`` may say something after ``in_flight`` more tokens (chosen, not yet fed)."""
        return bool(self._budget.forced or self._held) or self._budget.spent or (
            self._budget.budget is not None and self._budget.near(len(self._held) + in_flight))

    def draft_room(self, unlimited: int) -> int:
        return 0 if self._held else self._budget.room(0, unlimited)

    def _marker(self) -> tuple[int, ...]:
        return self.fmt.end if self.route is REASONING else self.fmt.start

    def _check_budget(self) -> None:
        budget = self._budget
        if self.route is REASONING and not budget.forced and budget.near(len(self._held)):
            budget.forced.extend(self.fmt.end[len(self._held):])
            budget.spent = True


class HarmonyTracker(_Tracker):
    """gpt-oss's messages: ``<|start|>`` header ``<|message|>`` body, ended by ``<|end|>``, ``<|call|>`` or
    ``<|return|>``. Headers are markup; a body goes where its header's channel says."""

    HEADER, BODY, BETWEEN = "header", "body", "between"

    def __init__(self, fmt: HarmonyFormat, prompt: Sequence[int], decode: Callable[[list[int]], str],
                 budget: int | None = None) -> None:
        self.fmt = fmt
        self.decode = decode
        self.generated = 0
        self.calls = 0
        self.route: Route = ANSWER
        self.state, self._header = self._from_prompt(prompt)
        self._budget = _Budget(budget)
        self._check_budget()

    @property
    def answering(self) -> bool:
        return self.state == self.BODY and self.route is ANSWER

    @property
    def opening_token(self) -> int | None:
        return None  # a header is free text: a grammar applies only inside an answer's body

    def feed(self, token: int) -> Routed:
        self.generated += 1
        self._budget.fed(token)
        fmt = self.fmt
        if self.state == self.BODY and token not in fmt.markup:
            if self.route is REASONING:
                self._budget.reasoning_tokens += 1
            self._check_budget()
            return [(token, self.route)]
        if token == fmt.message and self.state == self.HEADER:
            self.route, self.state, self._header = self._route_of(self._header), self.BODY, []
        elif token == fmt.start:
            self.state, self._header = self.HEADER, []
        elif token == fmt.channel:
            if self.state != self.HEADER:  # a header begun without <|start|>
                self.state, self._header = self.HEADER, []
            self._header.append(token)
        elif token in fmt.markup:
            self.state, self._header = self.BETWEEN, []
        elif self.state == self.HEADER:
            self._header.append(token)
            if len(self._header) > HEADER_LIMIT:
                return self._not_a_header()
        else:  # text between messages, outside any markup: the answer's
            self.state, self.route = self.BODY, ANSWER
            return [(token, ANSWER)]
        self._check_budget()
        return []

    def flush(self) -> Routed:
        return []  # a header left open is markup; bodies are never held

    def rule(self) -> TokenRule | None:
        budget = self._budget
        if budget.forced:
            return TokenRule(force=budget.forced[0])
        if budget.spent and self.state == self.HEADER and self._header[-1:] == [self.fmt.channel]:
            return TokenRule(forbid=(self.fmt.analysis[0],))
        return None

    def may_rule(self, in_flight: int = 1) -> bool:
        return bool(self._budget.forced) or self._budget.spent or self._budget.near(in_flight)

    def draft_room(self, unlimited: int) -> int:
        return self._budget.room(0, unlimited)

    def _check_budget(self) -> None:
        budget = self._budget
        if self.state == self.BODY and self.route is REASONING and not budget.forced and budget.near(0):
            fmt = self.fmt
            budget.forced.extend((fmt.end, fmt.start, *fmt.assistant, fmt.channel))
            budget.spent = True

    def _not_a_header(self) -> Routed:
        header, self._header = self._header, []
        self.state, self.route = self.BODY, ANSWER
        return [(t, ANSWER) for t in header]

    def _route_of(self, header: list[int]) -> Route:
        text = self.decode(header)
        channel = re.search(r"<\|channel\|>\s*([\w-]+)", text)
        recipient = re.search(r"\bto=([^\s<]+)", text)
        name = channel.group(1) if channel else ""
        if recipient is not None:
            route = Route(Channel.CALL, self.calls, recipient.group(1).removeprefix("functions."))
            self.calls += 1
            return route
        return REASONING if name == "analysis" else ANSWER

    def _from_prompt(self, prompt: Sequence[int]) -> tuple[str, list[int]]:
        """Where the prompt leaves off: in a header (the generation prompt ``<|start|>assistant``), in a body, or
        between messages."""
        fmt = self.fmt
        start = max((i for i, t in enumerate(prompt) if t == fmt.start), default=-1)
        if start < 0:
            return self.BETWEEN, []
        tail = list(prompt[start + 1:])
        if fmt.message not in tail:
            return self.HEADER, tail
        at = tail.index(fmt.message)
        if any(t in fmt.markup for t in tail[at + 1:]):
            return self.BETWEEN, []
        self.route = self._route_of(tail[:at])
        return self.BODY, []


ReasoningTracker = ThinkTracker | HarmonyTracker


def start_tracker(fmt: ReasoningFormat, prompt: Sequence[int], decode: Callable[[list[int]], str],
                  budget: int | None = None, constrained: bool = False) -> ReasoningTracker:
    if isinstance(fmt, HarmonyFormat):
        return HarmonyTracker(fmt, prompt, decode, budget)
    return ThinkTracker(fmt, prompt, budget, constrained)
