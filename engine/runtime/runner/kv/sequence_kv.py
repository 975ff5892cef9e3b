"""One agent's resident KV: a cache per model layer, and checkpoints of its window layers.

The engine thread owns it. A turn passes its layer caches to the model as
they are; :meth:`reserve` is the only place capacity grows, after the pool
has granted the blocks (``blocks_for`` says how many).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import mlx.core as mx
from mlx_lm.models.cache import CacheList

from engine.domain.cache_spec import KVGeometry, LayerGroup, ModelCacheSpec

from engine.runtime.runner.kv.chunked_kv import ChunkedKV, ChunkState
from engine.runtime.runner.kv.full_kv import FullKV, KVShape, parts_of
from engine.runtime.runner.kv.kinds import MLX_KINDS, LayerKinds
from engine.runtime.runner.kv.recurrent_state import RecurrentState, StateSnapshot
from engine.runtime.runner.kv.segment import Segment
from engine.runtime.runner.kv.shared_kv import SharedKV
from engine.runtime.runner.kv.window_kv import WindowKV, WindowState

# A layer that forgets (a sliding or a chunked window): it goes back only as far as it holds, or to a checkpoint.
WindowLike = WindowKV | ChunkedKV
# Layers that forget: a later position can go back only to a checkpoint (a snapshot, for a recurrent state).
Forgetting = WindowKV | ChunkedKV | RecurrentState
LayerKV = FullKV | WindowKV | ChunkedKV | RecurrentState
_FORGETTING = (WindowKV, ChunkedKV, RecurrentState)


class CheckpointKind(enum.Enum):
    TURN = "turn"  # the end of a turn's prompt: where the next turn's prompt may diverge
    PREFIX = "prefix"  # a prefix other agents may share (the end of the system prompt and tools)


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """The layers that forget, at ``offset`` tokens (one state per sliding, chunked or recurrent layer, in
    layer order): for a recurrent model, a snapshot of its state."""

    offset: int
    states: tuple[WindowState | ChunkState | StateSnapshot, ...]
    kind: CheckpointKind = CheckpointKind.TURN


DROPS_REMEMBERED = 8


def _word(kv: "SequenceKV", n: int) -> str:
    """What a checkpoint is called for this model: a snapshot of recurrent state, else a checkpoint."""
    noun = "snapshot" if kv.spec.recurrent_groups else "checkpoint"
    return f"{noun}{'s are' if n != 1 else ' is'}"


@dataclass(slots=True)
class SequenceKV:
    spec: ModelCacheSpec
    layers: list[LayerKV]
    checkpoints: list[Checkpoint] = field(default_factory=list)
    # Shared prefix of the full-attention layers, in order, covering positions [0, base).
    segments: list[Segment] = field(default_factory=list)
    # Bytes of K/V this cache has copied so far (growth, re-basing, copies in): the hand-off's cost.
    copied: int = 0
    # Checkpoints dropped lately, (offset, why), newest last: a turn that could only resume from an
    # earlier one is told which later one it missed and why (the agent's cache history).
    dropped: deque[tuple[int, str]] = field(default_factory=lambda: deque(maxlen=DROPS_REMEMBERED))

    @classmethod
    def empty(cls, spec: ModelCacheSpec, kinds: LayerKinds = MLX_KINDS) -> "SequenceKV":
        """A cache of no positions, its layers of the compute backend's ``kinds``, each of its group's geometry."""
        layers: list[LayerKV] = []
        for layer in range(spec.n_layers):
            group = spec.group_of(layer)
            if group.state is not None:
                layers.append(RecurrentState(group.state))
                continue
            if group.index in spec.quantized_groups:
                shape = kv_shape(spec.geometry_of(group), spec.kv_bits, spec.kv_group_size)
                layers.append(kinds.quantized(shape, spec.block_tokens))
                continue
            shape = kv_shape(spec.geometry_of(group))
            if group.window is not None:
                layers.append(kinds.window(shape, spec.block_tokens, group.window))
            elif group.chunk is not None:
                layers.append(kinds.chunked(shape, spec.block_tokens, group.chunk))
            else:
                layers.append(kinds.full(shape, spec.block_tokens))
        return cls(spec, layers)

    # -- sizes -------------------------------------------------------------------------
    @property
    def offset(self) -> int:
        return self.layers[0].offset

    @property
    def forgets(self) -> bool:
        """Whether some layers forget (sliding or chunked windows, recurrent states): a later position can go
        back only to a checkpoint, and a prefill pass may not carry filler."""
        return any(isinstance(layer, _FORGETTING) for layer in self.layers)

    def advanced(self, n: int) -> None:
        """``n`` tokens went through the model: recurrent states stand ``n`` further (K/V layers count their
        own writes)."""
        for layer in self.layers:
            if isinstance(layer, RecurrentState):
                layer.advanced(n)

    # -- speculative positions -------------------------------------------------------------
    def can_take_back(self, n_tokens: int) -> bool:
        """Whether ``n_tokens`` positions written next (a step's last token and its drafts) can be cut back to
        the first of them afterwards: full attention always; sliding windows with what the step overwrites kept
        aside (``undo_for``); chunked windows and recurrent states never (a state cannot go back)."""
        return n_tokens <= 1 or not any(isinstance(layer, (ChunkedKV, RecurrentState)) for layer in self.layers)

    def undo_for(self, n_tokens: int) -> list[Any]:
        """Before a speculative step writes ``n_tokens`` positions: each sliding window's columns it overwrites."""
        return [layer.undo_for(n_tokens) for layer in self.layers if isinstance(layer, WindowKV)]

    def take_back(self, n_tokens: int, written_in_place: bool = False, undo: Sequence[Any] = ()) -> None:
        """Forget the last ``n_tokens`` positions (rejected drafts; ``can_take_back`` held before they were
        written, and ``undo`` is what ``undo_for`` kept then). ``written_in_place``: the host loops wrote them
        where no view can show them, so they may be claimed again (``HostFullKV.give_back_claimed``)."""
        if n_tokens <= 0:
            return
        keep = self.offset - n_tokens
        rings = iter(undo)
        for layer in self.layers:
            if isinstance(layer, WindowKV):
                layer.undo(next(rings), keep)
            elif written_in_place and hasattr(layer, "give_back_claimed"):
                layer.give_back_claimed(keep)
            else:
                layer.trim_to(keep)

    @property
    def base(self) -> int:
        """Positions served by shared segments."""
        return self.segments[-1].end if self.segments else 0

    def capacity_blocks(self) -> dict[int, int]:
        """Pool blocks this sequence's own arrays occupy per layer group (checkpoints included, shared
        segments not: every agent that refers to a segment holds its blocks)."""
        spec = self.spec
        blocks = {g.index: _own_blocks(self._lead(g), spec.block_tokens) * spec.group_units(g) for g in spec.groups}
        for checkpoint in self.checkpoints:
            for group, n in self._checkpoint_blocks(checkpoint).items():
                blocks[group] += n
        return blocks

    def blocks_for(self, n_tokens: int) -> dict[int, int]:
        """Pool blocks per group after ``reserve(n_tokens)`` (checkpoints included: a chunked layer's relayout
        gives the checkpoints sharing its run copies of their own)."""
        blocks = self.capacity_blocks()
        for g in self.spec.groups:
            lead = self._lead(g)
            if isinstance(lead, RecurrentState):
                blocks[g.index] += (lead.capacity_for(n_tokens) - lead.capacity) * self.spec.group_units(g)
                continue
            grown = (lead.capacity_for(n_tokens) - lead.capacity) // self.spec.block_tokens
            if isinstance(lead, ChunkedKV) and lead.will_relay(n_tokens):
                grown += sum(lead.compact_columns(state) for state in self._states_of(g.layers[0])
                             if lead.shares(state)) // self.spec.block_tokens
            blocks[g.index] += grown * self.spec.group_units(g)
        return blocks

    def reserve(self, n_tokens: int) -> int:
        """Grow every layer to hold ``n_tokens`` positions; returns bytes copied."""
        self._unshare_checkpoints(lambda layer: layer.will_relay(n_tokens))
        copied = sum(layer.reserve(n_tokens) for layer in self.layers)
        self.copied += copied
        return copied

    def shrink(self) -> int:
        """Give back own capacity far beyond the positions held (after a turn or a cut: a chunked layer's
        columns its chunk no longer needs); returns bytes copied.

        A chunked layer whose checkpoints share its run shrinks only where the run and their copies together
        come out smaller, so the pool's count never grows here."""
        copied = 0
        for i, layer in enumerate(self.layers):
            if isinstance(layer, ChunkedKV) and layer.would_shrink():
                shared = [state for state in self._states_of(i) if layer.shares(state)]  # type: ignore[arg-type]
                if shared:
                    after = layer.shrunk_columns() + sum(layer.compact_columns(s) for s in shared)  # type: ignore[arg-type]
                    if after >= layer.capacity:
                        continue
                    self._unshare_checkpoints(lambda other, layer=layer: other is layer)
            copied += layer.shrink()
        self.copied += copied
        return copied

    def _states_of(self, layer_index: int) -> list[WindowState | ChunkState]:
        """Every checkpoint's state of one window layer."""
        slot = self.window_layer_ids().index(layer_index)
        return [c.states[slot] for c in self.checkpoints]

    def _unshare_checkpoints(self, relays: Callable[[ChunkedKV], bool]) -> None:
        """Before chunked layers lay their runs out anew, the checkpoints sharing them get copies of their
        chunks (the pool paid for them in :meth:`blocks_for`)."""
        ids = self.window_layer_ids()
        moving = {slot for slot, i in enumerate(ids)
                  if isinstance(self.layers[i], ChunkedKV) and relays(self.layers[i])}  # type: ignore[arg-type]
        if not moving or not self.checkpoints:
            return
        for n, checkpoint in enumerate(self.checkpoints):
            states = list(checkpoint.states)
            for slot in moving:
                layer = self.layers[ids[slot]]
                if layer.shares(states[slot]):  # type: ignore[union-attr, arg-type]
                    states[slot] = layer.compact(states[slot])  # type: ignore[union-attr, arg-type]
            self.checkpoints[n] = replace(checkpoint, states=tuple(states))

    @property
    def nbytes(self) -> int:
        """What the pool counts for this sequence's own arrays and checkpoints."""
        return sum(self.capacity_blocks().values()) * self.spec.block_bytes

    def arrays(self) -> list[mx.array]:
        """Every array of the own layers (K/V and recurrent states), to evaluate after a pass."""
        return [a for layer in self.layers for a in arrays_of(layer)]

    def checkpoint_bytes(self) -> int:
        """What the pool counts for the checkpoints (part of :attr:`nbytes`)."""
        units = sum(n for c in self.checkpoints for n in self._checkpoint_blocks(c).values())
        return units * self.spec.block_bytes

    def array_bytes(self) -> int:
        """Bytes of the arrays themselves (own layers and checkpoints, each array once: a chunked layer's
        checkpoints may share its run; shared segments not included)."""
        arrays = [a for layer in self.layers for a in arrays_of(layer)]
        # (A chunked checkpoint sharing its layer's run adds no array: counted once, as the pool does.)
        own = [state for c in self.checkpoints for state, layer in zip(c.states, self._windows())
               if not (isinstance(layer, ChunkedKV) and layer.shares(state))]  # type: ignore[arg-type]
        arrays += [a for state in own for a in arrays_of(state)]
        return sum(a.nbytes for a in arrays if a is not None)

    def caches(self) -> list[Any]:
        """The per-layer caches, in the order the model takes them; a KV-shared layer (Gemma 4) gets a view of
        the cache it reads."""
        return model_caches(self.spec, [*self.layers, *(SharedKV(self.layers[source]) for source in self.spec.shared_layers)])

    # -- continuing from an earlier position ---------------------------------------------
    def resumable_at(self, n_tokens: int) -> int:
        """The largest position <= ``n_tokens`` this cache can continue from (0: none)."""
        n_tokens = min(n_tokens, self.offset)
        if all(layer.can_continue_from(n_tokens) for layer in self._windows()):
            return n_tokens
        checkpoint = self._checkpoint_at_or_before(n_tokens)
        return checkpoint.offset if checkpoint is not None else 0

    def continue_from(self, n_tokens: int) -> int:
        """Cut the cache back to ``resumable_at(n_tokens)`` positions; returns that position.

        Going back into the shared prefix keeps the segments that end before
        the cut and copies the rest into the sequence's own arrays.
        """
        n_tokens = min(n_tokens, self.offset)
        windows = self._windows()
        if not all(layer.can_continue_from(n_tokens) for layer in windows):
            checkpoint = self._checkpoint_at_or_before(n_tokens)
            n_tokens = checkpoint.offset if checkpoint is not None else 0
            for layer, state in zip(windows, checkpoint.states if checkpoint else ()):
                layer.restore(state)
            if checkpoint is None:
                for layer in windows:
                    layer.reset()
        if n_tokens < self.base:
            self._rebase([s for s in self.segments if s.end <= n_tokens], n_tokens)
        for layer in self.layers:
            if isinstance(layer, FullKV) or layer.offset != n_tokens:
                layer.trim_to(n_tokens)
        self.checkpoints = [c for c in self.checkpoints if c.offset <= n_tokens]
        return n_tokens

    # -- shared segments -------------------------------------------------------------------
    def freeze(self, upto: int) -> Segment | None:
        """Turn own positions ``[base, upto)`` into a new shared segment (whole blocks); None if empty.

        Both sides are copies: the segment's arrays, and the own tail re-based
        after it. The sequence's capacity stays the same, so its pool blocks
        only change hands (the caller moves them to the segment).
        """
        upto = upto // self.spec.block_tokens * self.spec.block_tokens
        base = self.base
        if upto <= base or upto > self.offset:
            return None
        full = self._full()
        parts = [layer.positions(base, upto) for layer in full]
        segment = Segment(base, upto, tuple(_contiguous(k) for k, _ in parts), tuple(_contiguous(v) for _, v in parts))
        self.copied += segment.array_bytes()
        self._rebase(self.segments + [segment], None)
        return segment

    def adopt(self, segments: list[Segment]) -> None:
        """Start an empty cache from shared segments (before reserving room for what follows them)."""
        assert self.offset == 0 and not self.segments
        self._rebase(list(segments), None)

    def _rebase(self, segments: list[Segment], upto: int | None) -> None:
        full = self._full()
        for i, layer in enumerate(full):
            prefix = [(s.keys[i], s.values[i]) for s in segments]
            base = segments[-1].end if segments else 0
            keep = layer.capacity if upto is None else base + _round_up(upto - base, self.spec.block_tokens)
            if upto is not None:
                layer.offset = min(layer.offset, upto)
            self.copied += layer.rebase(prefix, max(keep, base))
        self.segments = segments
        mx.eval([a for layer in full for a in (layer.keys, layer.values)] + [a for s in segments for a in (*s.keys, *s.values)])

    # -- checkpoints -------------------------------------------------------------------
    def take_checkpoint(self, kind: CheckpointKind, keep: int) -> None:
        """Remember the window layers as they are now; keeps the ``keep`` latest checkpoints of ``kind``."""
        windows = self._windows()
        if not windows or keep <= 0 or any(c.offset == self.offset for c in self.checkpoints):
            return
        self.checkpoints.append(Checkpoint(self.offset, tuple(layer.state_now() for layer in windows), kind))
        same = [c for c in self.checkpoints if c.kind is kind]
        for old in same[:-keep]:
            self.checkpoints.remove(old)
            self.dropped.append((old.offset, f"only the latest {keep} {kind.value} {_word(self, keep)} kept"))

    def drop_oldest_checkpoint(self, keep: int = 0) -> bool:
        """Free the least useful checkpoint (turn ends before shared prefixes, oldest first), sparing the
        newest ``keep``."""
        spare = sorted(self.checkpoints, key=lambda c: c.offset)[:max(len(self.checkpoints) - keep, 0)]
        if not spare:
            return False
        victim = min(spare, key=lambda c: (c.kind is CheckpointKind.PREFIX, c.offset))
        self.checkpoints.remove(victim)
        self.dropped.append((victim.offset, "the pool needed room"))
        return True

    def drop_newest_checkpoint(self) -> None:
        if self.checkpoints:
            newest = max(self.checkpoints, key=lambda c: c.offset)
            self.checkpoints.remove(newest)
            self.dropped.append((newest.offset, "no room in the pool to keep it"))

    def dropped_between(self, start: int, end: int) -> tuple[int, str] | None:
        """The latest dropped checkpoint in ``(start, end]``: the one a resume from ``start`` missed."""
        missed = [(offset, why) for offset, why in self.dropped if start < offset <= end]
        return max(missed) if missed else None

    def _checkpoint_at_or_before(self, n_tokens: int) -> Checkpoint | None:
        candidates = [c for c in self.checkpoints if c.offset <= n_tokens]
        return max(candidates, key=lambda c: c.offset) if candidates else None

    def _checkpoint_blocks(self, checkpoint: Checkpoint) -> dict[int, int]:
        by_layer = dict(zip(self.window_layer_ids(), checkpoint.states))
        return {
            g.index: _state_blocks(self._lead(g), by_layer[g.layers[0]], self.spec.block_tokens)
            * self.spec.group_units(g)
            for g in self.spec.sliding_groups
        }

    # -- copies in and out -----------------------------------------------------------------
    def copy_prefix_from(self, donor: "SequenceKV", n_tokens: int) -> int:
        """Become the first ``n_tokens`` positions of ``donor`` (capacity reserved); returns bytes copied.

        Full-attention positions before this cache's own ``base`` (segments it
        already shares with the donor) are not copied. ``donor.resumable_at(n_tokens)
        == n_tokens`` must hold: window layers copy the donor's ring or its
        checkpoint at ``n_tokens``.

        The copy stays in the graph for the sequence's first prefill pass. Evaluated here it would also
        materialize the whole reserved capacity (a long prompt's: hundreds of MB, most of a second on a small
        CPU) at admission, between steps, where every running agent and any urgent turn arriving would wait
        for it; in the pass, it lands where the scheduler placed that prompt.
        """
        checkpoint = next((c for c in donor.checkpoints if c.offset == n_tokens), None)
        states = iter(checkpoint.states if checkpoint is not None else ())
        copied = 0
        for mine, theirs in zip(self.layers, donor.layers):
            if isinstance(mine, FullKV):
                if n_tokens > mine.base:
                    mine.load(*theirs.positions(mine.base, n_tokens))
                copied += (n_tokens - mine.base) * mine.shape.token_bytes()
            else:
                state = next(states) if checkpoint is not None else theirs.state_now()
                copied += _copy_window(mine, state, n_tokens)
        self.copied += copied
        return copied

    # -- helpers -----------------------------------------------------------------------
    def _lead(self, group: LayerGroup) -> LayerKV:
        return self.layers[group.layers[0]]

    def _full(self) -> list[FullKV]:
        return [layer for layer in self.layers if isinstance(layer, FullKV)]

    def _windows(self) -> list[Forgetting]:
        """The layers that forget (windows and recurrent states), in layer order: a checkpoint's states."""
        return [layer for layer in self.layers if isinstance(layer, _FORGETTING)]

    def window_layer_ids(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if isinstance(layer, _FORGETTING)]


def model_caches(spec: ModelCacheSpec, layers: list[Any]) -> list[Any]:
    """Per cache layer ``layers`` as the model takes them: where a model layer keeps two caches (mlx-lm's
    ``CacheList``), one ``CacheList`` of its cache layers."""
    if not spec.cache_lists:
        return layers
    return [CacheList(*(layers[i] for i in entry)) for entry in spec.cache_lists]


def kv_shape(geometry: KVGeometry, bits: int | None = None, group_size: int = 64) -> KVShape:
    """The MLX shape of one layer's cache of ``geometry`` (held quantized at ``bits``: None, plain)."""
    return KVShape(geometry.n_kv_heads, geometry.head_dim, geometry.v_head_dim, getattr(mx, geometry.dtype),
                   bits, group_size)


def _state_blocks(layer: LayerKV, state: WindowState | ChunkState | StateSnapshot, block_tokens: int) -> int:
    """Blocks of its group a checkpoint's state holds of its own: a recurrent snapshot one, a window's ring
    its columns' (none where it shares a chunked layer's run)."""
    if isinstance(state, StateSnapshot):
        return 1 if state.arrays is not None else 0
    if isinstance(layer, ChunkedKV) and layer.shares(state):  # type: ignore[arg-type]
        return 0
    return state.capacity // block_tokens


def _own_blocks(layer: LayerKV, block_tokens: int) -> int:
    """Blocks of its group a layer's own arrays take (a recurrent state: one, once it holds a token)."""
    if isinstance(layer, RecurrentState):
        return layer.capacity
    return (layer.own_capacity if isinstance(layer, FullKV) else layer.capacity) // block_tokens


def arrays_of(holder: Any) -> list[mx.array]:
    """The arrays a layer or a checkpoint's state holds."""
    if isinstance(holder, RecurrentState):
        return holder.arrays
    if isinstance(holder, StateSnapshot):
        return list(holder.arrays or ())
    return [a for held in (holder.keys, holder.values) if held is not None for a in parts_of(held)]


def _contiguous(held: Any) -> Any:
    """A K or V copied into arrays of its own (each of a packed one's three)."""
    return tuple(mx.contiguous(a) for a in held) if isinstance(held, tuple) else mx.contiguous(held)


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def _copy_window(mine: Forgetting, state: WindowState | ChunkState | StateSnapshot, n_tokens: int) -> int:
    """Load positions up to ``n_tokens`` of a window state into an empty window layer (room reserved); a
    recurrent layer takes the snapshot's arrays (MLX arrays are values: the next pass replaces them rather
    than write into them, so holding the same arrays is a copy that costs nothing yet)."""
    if isinstance(mine, RecurrentState):
        assert isinstance(state, StateSnapshot) and state.offset == n_tokens, (state.offset, n_tokens)
        if state.arrays is None:
            mine.reset()
            return 0
        mine.load(n_tokens, state.arrays)
        return state.nbytes
    source = mine.blank()
    source.restore(state)  # type: ignore[arg-type]
    source.trim_to(n_tokens)
    keep = min(source.needed, n_tokens)
    keys, values = source.recent(keep)
    mine.load_from(n_tokens - keep, keys, values)
    return keep * mine.shape.token_bytes()
