"""Where a JSON reply is as it is written, byte by byte: inside a string or not, and whether an array is
repeating its items.

Small models under a schema loop inside arrays: ``"tags": ["pets", "pets", "pets", ...`` or
``["make-tea-steps-1.json", "make-tea-steps-2.json", ...`` until ``max_tokens``, greedy or sampled (greedy
SmolLM2 ran 40 of 50 open-schema requests to the cap: bench_structured_outputs, the 2-core CPU box). A token guard sees
the first only after hundreds of tokens, and the second never exactly; here an array's items are compared as
whole values (case ignored). An array loops when at least half its items equal an earlier one, and either
``REPEATS`` of them are equal as written or more are once the digits in their strings are folded (a counter
that moves on: ``"step-7.json"``; never the numbers outside strings): four string items, six objects or
arrays, sixteen strings with fewer than three letters (``"3.10"``, years: likelier data; but Gemma 3 counts
``["1", "2", ...`` to ``max_tokens``). ``[0, 0, 255]`` or ``["a", "b", "a"]`` do not; scalars (numbers,
booleans, null) are never compared. Over the 163 JSON files of this repository and its installed packages
the rule fires on 2: a model config's identical layers and a report's notes that differ only in their
numbers (``python -m bench.loop_false_positives``, docs/structured-outputs.md).

The shape also says whether the next byte is inside a string, which is what steering a reply closed needs
(grammar/loop_closing.py): a ``"`` closes the string there and opens one elsewhere. Text before the first
``{`` or ``[`` (a tool-call format's markup, a preamble) is skipped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

REPEATS = 3  # items equal to an earlier item of their array that make it a loop (with half its items)
# ... when some are equal only once the digits in their strings are folded (a counter, or data: "Python 3.9",
# "Python 3.10"): string items, and objects and arrays, whose other fields make data likelier (a package's
# classifiers, {"name": ..., "value": "Python :: 3.9"}, repeat 5 of 8 items folded; a model's
# {"name": "Team7", "role": "manager"} loop goes on)
FOLDED_REPEATS = 4
FOLDED_CONTAINER_REPEATS = 6
# ... and string items with fewer letters than LETTERS_TO_FOLD, which are likelier data ("3.10", "v2", years),
# need many: Gemma 3 under an open schema counts ["1", "2", ..., "59", ... to max_tokens
LETTERS_TO_FOLD = 3
FOLDED_SHORT_REPEATS = 16
_DIGITS = re.compile(rb"[0-9]+")
_LETTERS = re.compile(rb"[a-zA-Z]")
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


@dataclass(frozen=True, slots=True)
class RepeatedItems:
    items: int  # items the array holds
    repeats: int  # of them, equal to an earlier one (digits folded)
    item: str  # the last one, as written (for the note)

    def describe(self) -> str:
        return f"an array repeating its items: {self.repeats} of {self.items} repeat an earlier one, e.g. {self.item}"


@dataclass(slots=True)
class _Container:
    opener: int  # ord("[") or ord("{")
    item_start: int = -1  # where the array's current item starts in the text (-1: between items; -2: one ended)
    items: int = 0
    repeats: int = 0  # items equal to an earlier one as written (case ignored)
    folded_repeats: int = 0  # items equal to an earlier one only with their digits folded
    seen: set[bytes] = field(default_factory=set)
    seen_folded: set[bytes] = field(default_factory=set)

    def kind_of_repeat(self, item: bytes) -> tuple[bytes, bytes, int]:
        """``item``'s keys (as written, folded) and how it repeats: 0 new, 1 as written, 2 folded only."""
        exact = item.strip().lower()
        folded = _folded(exact)
        if exact in self.seen:
            return exact, folded, 1
        return exact, folded, 2 if folded in self.seen_folded else 0

    def loops_with(self, item: bytes, repeat: int) -> bool:
        """Whether the array, with one more ``item`` repeating as ``repeat`` says, has become a loop."""
        repeats = self.repeats + (repeat == 1)
        folded = self.folded_repeats + (repeat == 2)
        items = self.items + 1
        if 2 * (repeats + folded) < items:
            return False
        if not item.lstrip().startswith(b'"'):
            enough = FOLDED_CONTAINER_REPEATS
        else:
            enough = FOLDED_REPEATS if len(_LETTERS.findall(item)) >= LETTERS_TO_FOLD else FOLDED_SHORT_REPEATS
        return repeats >= REPEATS or repeats + folded >= enough


@dataclass(slots=True)
class JsonShape:
    _text: bytearray = field(default_factory=bytearray)
    _open: list[_Container] = field(default_factory=list)
    in_string: bool = False
    _escaped: bool = False
    _string_is_item: bool = False  # the open string is an array's item (its closing quote ends the item)
    # Set once: the first array found repeating.
    repeated: RepeatedItems | None = None

    def feed(self, data: bytes) -> RepeatedItems | None:
        """Read the reply's next bytes; the array that just became a loop, the first time one does."""
        found = None
        for byte in data:
            position = len(self._text)
            self._text.append(byte)
            if self.in_string:
                found = self._in_string(byte, position) or found
            elif self._open or byte in b"[{":
                found = self._structure(byte, position) or found
        found = found or self._item_would_repeat()
        if found is not None and self.repeated is None:
            self.repeated = found
            return found
        return None

    def _item_would_repeat(self) -> RepeatedItems | None:
        """The array item being written (a string, or an object at its last value), closed now, would make its array
        a loop: say so before its closing quote or brace, so that the closing token can close the array too
        (``"]``, ``"}]``) and no item has to follow a comma (a tokenizer often writes ``",`` or ``},`` as one
        token)."""
        if self._escaped:
            return None
        if self.in_string and self._string_is_item:
            array, suffix = self._open[-1], b'"'
        elif (len(self._open) >= 2 and self._open[-1].opener == 0x7B and self._open[-2].opener == 0x5B
              and self._open[-2].item_start >= 0):
            array, suffix = self._open[-2], (b'"}' if self.in_string else b"}")
        else:
            return None
        if not array.seen:
            return None  # nothing to repeat yet (and no copy of a long first item on every token)
        item = bytes(self._text[array.item_start:]) + suffix
        exact, folded, repeat = array.kind_of_repeat(item)
        if not repeat or not array.loops_with(item, repeat):
            return None
        partial = exact[:len(exact) - len(suffix)]
        if any(len(seen) > len(exact) and seen.startswith(partial) for seen in array.seen):
            return None  # it may yet become a longer item already seen ("a" on its way to "aa")
        return RepeatedItems(array.items + 1, array.repeats + array.folded_repeats + 1,
                             item.decode("utf-8", "replace")[:60])

    @property
    def depth(self) -> int:
        return len(self._open)

    def _in_string(self, byte: int, position: int) -> RepeatedItems | None:
        if self._escaped:
            self._escaped = False
        elif byte == 0x5C:  # backslash
            self._escaped = True
        elif byte == 0x22:  # the closing quote
            self.in_string = False
            if self._string_is_item:
                self._string_is_item = False
                return self._item_ends(position)
        return None

    def _structure(self, byte: int, position: int) -> RepeatedItems | None:
        top = self._open[-1] if self._open else None
        if byte in b" \t\r\n":
            return None
        if top is not None and top.opener == 0x5B and top.item_start < 0 and byte not in b",]":
            top.item_start = position  # an array's item begins
        if byte == 0x22:
            self.in_string = True
            self._string_is_item = top is not None and top.opener == 0x5B and top.item_start == position
        elif byte in b"[{":
            self._open.append(_Container(byte))
        elif byte in b"]}":
            if self._open:
                self._open.pop()
            parent = self._open[-1] if self._open else None
            if parent is not None and parent.opener == 0x5B and parent.item_start >= 0:
                return self._item_ends(position)  # the container was the parent array's item
        elif byte == 0x2C and top is not None and top.opener == 0x5B:
            top.item_start = -1  # a scalar item (never compared) or the separator after an ended item
        return None

    def _item_ends(self, position: int) -> RepeatedItems | None:
        array = self._open[-1]
        item = bytes(self._text[array.item_start:position + 1])
        array.item_start = -2  # ended: the separator or the closing bracket comes next
        exact, folded, repeat = array.kind_of_repeat(item)
        loops = array.loops_with(item, repeat)
        array.items += 1
        array.repeats += repeat == 1
        array.folded_repeats += repeat == 2
        array.seen.add(exact)
        array.seen_folded.add(folded)
        if loops:
            return RepeatedItems(array.items, array.repeats + array.folded_repeats,
                                 item.decode("utf-8", "replace")[:60])
        return None


def _folded(item: bytes) -> bytes:
    """An item with the digits in its strings folded (``"step-7.json"`` is ``"step-0.json"``); numbers outside
    strings are kept (``{"x": 1}`` and ``{"x": 2}`` are two points, not a loop)."""
    if item.startswith(b'"'):
        return _DIGITS.sub(b"0", item)
    return _STRING.sub(lambda m: _DIGITS.sub(b"0", m.group(0)), item)
