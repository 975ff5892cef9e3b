"""The KV-cache layout of a model, independent of MLX.

Layers are partitioned into *layer groups*: layers of one kind (full
attention, a sliding window of W tokens, a chunked window of C tokens) and of
one geometry (K/V heads, widths, dtype) make one or more groups of equal size
(the vLLM v1 hybrid-allocator idea). A uniform model is one group of all its
layers; Gemma 3 (3 global + 15 sliding layers) becomes 1 global group and 5
sliding groups of 3. A *block* of a group holds ``block_tokens`` tokens of K
and V for every layer of that group.

Groups of different geometry (Gemma 4's global layers are twice as wide as
its sliding ones) have blocks of different byte sizes. The pool counts them
in one unit, ``block_bytes``: the greatest common divisor of the groups'
block sizes, so a group's block is a whole number of pool blocks
(``group_units``) and the pool's bytes are exactly what the arrays hold. A
uniform model's unit is its one block size, as it always was.

A latent-attention model (DeepSeek V3, GLM-4.7-Flash, Kimi K2.5) caches one
latent vector and one rotary key per token under a single "head": its
geometry is one head of ``kv_lora_rank`` (K) and ``qk_rope_head_dim`` (V).

A *recurrent* layer (linear attention, Mamba, RWKV: mlx-lm's ``ArraysCache``)
keeps a fixed-size state per sequence instead of K/V per token: the same
bytes at 10 tokens or 100K. Its group's "block" is the state of its layers,
one per sequence holding any token (and one per snapshot of it: a state
cannot be cut back, so a sequence resumes only where a snapshot was kept).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import reduce

DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int8": 1,
    "uint8": 1,
}


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """What one token of one layer stores: K and V of ``n_kv_heads`` heads, ``head_dim`` and ``v_head_dim``
    wide, in ``dtype``."""

    n_kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype: str

    def __post_init__(self) -> None:
        if min(self.n_kv_heads, self.head_dim, self.v_head_dim) <= 0:
            raise ValueError(f"invalid K/V geometry: {self}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}")

    @property
    def token_bytes(self) -> int:
        return self.n_kv_heads * (self.head_dim + self.v_head_dim) * DTYPE_BYTES[self.dtype]

    def quantized_token_bytes(self, bits: int, group_size: int) -> int:
        """One token's K and V as ``mx.quantize`` packs them along the head dimension: ``bits`` a value in
        uint32 words, and a scale and a bias (in ``dtype``) per ``group_size`` values."""
        scale_bias = 2 * DTYPE_BYTES[self.dtype]
        return self.n_kv_heads * sum(dim * bits // 8 + dim // group_size * scale_bias
                                     for dim in (self.head_dim, self.v_head_dim))

    def quantizes(self, bits: int, group_size: int) -> bool:
        """Whether both widths split into whole groups and whole uint32 words."""
        return all(dim % group_size == 0 and dim * bits % 32 == 0 for dim in (self.head_dim, self.v_head_dim))

    def describe(self) -> dict[str, object]:
        return {"n_kv_heads": self.n_kv_heads, "head_dim": self.head_dim, "v_head_dim": self.v_head_dim,
                "dtype": self.dtype}


@dataclass(frozen=True, slots=True)
class StateGeometry:
    """What one recurrent layer keeps per sequence: arrays of these shapes (without the batch axis) and
    dtypes (a convolution window, a recurrent matrix...), in mlx-lm's ``ArraysCache`` order."""

    arrays: tuple[tuple[tuple[int, ...], str], ...]

    def __post_init__(self) -> None:
        if not self.arrays:
            raise ValueError("a recurrent state needs at least one array")
        for shape, dtype in self.arrays:
            if not shape or min(shape) <= 0 or dtype not in DTYPE_BYTES:
                raise ValueError(f"invalid recurrent state array {shape} {dtype}")

    @property
    def bytes(self) -> int:
        return sum(math.prod(shape) * DTYPE_BYTES[dtype] for shape, dtype in self.arrays)

    def describe(self) -> dict[str, object]:
        return {"arrays": [[list(shape), dtype] for shape, dtype in self.arrays]}

    def summary(self) -> str:
        return " + ".join("x".join(map(str, shape)) + f" {dtype}" for shape, dtype in self.arrays)


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Layers that share one block table. ``window``: a sliding window (None: full attention, or chunked);
    ``chunk``: a chunked window (the layer attends to its chunk of ``chunk`` tokens); ``geometry``: None for
    the spec's own; ``state``: a recurrent group's per-layer state (its block: the states of its layers)."""

    index: int
    layers: tuple[int, ...]
    window: int | None = None
    geometry: KVGeometry | None = None
    chunk: int | None = None
    state: StateGeometry | None = None

    @property
    def is_sliding(self) -> bool:
        return self.window is not None

    @property
    def is_chunked(self) -> bool:
        return self.chunk is not None

    @property
    def is_recurrent(self) -> bool:
        return self.state is not None

    @property
    def holds_every_position(self) -> bool:
        """Full attention: a cut-back cache keeps all it had (windows forget what fell out; a recurrent
        state holds no position at all)."""
        return self.window is None and self.chunk is None and self.state is None

    @property
    def kind(self) -> str:
        if self.state is not None:
            return "recurrent"
        if self.chunk is not None:
            return f"chunked-{self.chunk}"
        return f"sliding-{self.window}" if self.window else "global"


@dataclass(frozen=True, slots=True)
class ModelCacheSpec:
    """Per-model KV layout: what each layer group's block holds and what the pool counts it as.

    ``n_kv_heads``/``head_dim``/``v_head_dim``/``dtype`` are the model's
    geometry, that of every group without one of its own. ``shared_layers``:
    for each model layer past ``n_layers`` (which keep no cache: Gemma 4's
    KV-shared layers), the cache layer whose K/V it attends to.
    ``batchable``: whether rows of one forward pass may each keep their own
    cache (not where the model works on its caches' arrays itself, as
    DeepSeek V3.2's sparse-attention indexer does). ``latent``: the model
    computes with the K/V it fetches (latent attention's rotary scores), so a
    batch hands it every row's K/V padded to the longest, not only the pass's
    new K/V (``runner/kv/padded.py``).
    A model of recurrent layers only (Mamba, RWKV) has no K/V: its own
    geometry is a nominal one head of width 1 that no group uses.
    """

    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str
    block_tokens: int
    groups: tuple[LayerGroup, ...]
    v_head_dim: int | None = None
    layer_windows: tuple[int | None, ...] = field(default=())
    # (rank, world size) when the model is sharded across processes: this rank's blocks hold its
    # shard of the heads (or layers), and its cache files are only ever read back by the same rank.
    shard: tuple[int, int] | None = None
    layer_chunks: tuple[int | None, ...] = field(default=())
    shared_layers: tuple[int, ...] = field(default=())
    batchable: bool = True
    latent: bool = False
    # Where a model layer keeps two caches (mlx-lm's CacheList: a Mamba state beside K/V, two attention
    # passes): per model layer, the cache layers it takes together, in order. Empty: one cache layer each.
    cache_lists: tuple[tuple[int, ...], ...] = field(default=())
    # The hot pool's K/V quantization (``--kv-bits``): the full-attention groups that can take it hold their
    # K/V packed (``quantized_groups``); None: full precision. A property of this process's pool, not of the
    # layout: ``describe`` (the cache files' fingerprint) leaves it out, and a file records its own.
    kv_bits: int | None = None
    kv_group_size: int = 64

    def __post_init__(self) -> None:
        if self.n_layers <= 0 or self.n_kv_heads <= 0 or self.head_dim <= 0:
            raise ValueError(f"invalid cache spec dimensions: {self}")
        if self.block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, got {self.block_tokens}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}")
        covered = sorted(layer for g in self.groups for layer in g.layers)
        if covered != list(range(self.n_layers)):
            raise ValueError("layer groups must cover every layer exactly once")
        if self.cache_lists and [i for entry in self.cache_lists for i in entry] != list(range(self.n_layers)):
            raise ValueError(f"cache lists must take every cache layer once, in order, got {self.cache_lists}")
        if any(not 0 <= source < self.n_layers for source in self.shared_layers):
            raise ValueError(f"shared layers must read a cache layer, got {self.shared_layers}")
        kinds: dict[tuple[object, ...], set[int]] = {}
        for g in self.groups:
            kinds.setdefault((g.window, g.chunk, g.state or self.geometry_of(g)), set()).add(len(g.layers))
        if any(len(sizes) != 1 for sizes in kinds.values()):
            raise ValueError("layer groups of one kind and geometry must have equal sizes")
        if len({g.dtype for g in self.geometries}) > 1:
            raise ValueError("every layer group must store K/V in one dtype")

    # -- geometry ---------------------------------------------------------------
    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim if self.v_head_dim is not None else self.head_dim

    @property
    def geometry(self) -> KVGeometry:
        """The model's own geometry (every group's without one of its own)."""
        return KVGeometry(self.n_kv_heads, self.head_dim, self.value_head_dim, self.dtype)

    def geometry_of(self, group: LayerGroup) -> KVGeometry:
        return group.geometry or self.geometry

    def layer_geometry(self, layer: int) -> KVGeometry:
        return self.geometry_of(self.group_of(layer))

    def group_of(self, layer: int) -> LayerGroup:
        return next(g for g in self.groups if layer in g.layers)

    @property
    def geometries(self) -> tuple[KVGeometry, ...]:
        """Every distinct K/V geometry a group stores, the model's own first."""
        found = [self.geometry_of(g) for g in self.groups if not g.is_recurrent]
        own = [self.geometry] if self.geometry in found else []
        return tuple(dict.fromkeys(own + found))

    @property
    def head_dims(self) -> tuple[int, ...]:
        """Every K and V width a layer of the model stores."""
        return tuple(sorted({d for g in self.geometries for d in (g.head_dim, g.v_head_dim)}))

    @property
    def is_uniform(self) -> bool:
        """One K/V geometry, no recurrent layers: every block is one pool block."""
        return len(self.geometries) == 1 and not self.recurrent_groups

    @property
    def recurrent_groups(self) -> tuple[LayerGroup, ...]:
        return tuple(g for g in self.groups if g.is_recurrent)

    @property
    def state_bytes(self) -> int:
        """Bytes of one sequence's recurrent state (all recurrent layers; 0 without any)."""
        return sum(self.group_block_bytes(g) for g in self.recurrent_groups)

    # -- sizes ------------------------------------------------------------------
    @property
    def bytes_per_token_per_layer(self) -> int:
        """One token of one layer of the model's own geometry."""
        return self.geometry.token_bytes

    def group_block_bytes(self, group: LayerGroup) -> int:
        """Bytes of one of ``group``'s blocks: K and V of ``block_tokens`` tokens for its layers (a recurrent
        group: its layers' states), packed where the group is quantized."""
        if group.state is not None:
            return group.state.bytes * len(group.layers)
        return self.group_token_bytes(group) * len(group.layers) * self.block_tokens

    def group_token_bytes(self, group: LayerGroup) -> int:
        """One token of one of ``group``'s layers, as its blocks hold it."""
        geometry = self.geometry_of(group)
        if self.kv_bits is not None and group.index in self.quantized_groups:
            return geometry.quantized_token_bytes(self.kv_bits, self.kv_group_size)
        return geometry.token_bytes

    # -- the hot pool's quantization --------------------------------------------------
    @property
    def quantized_groups(self) -> frozenset[int]:
        """The groups whose blocks hold quantized K/V (empty at full precision)."""
        if self.kv_bits is None:
            return frozenset()
        return frozenset(g.index for g in self.groups if self.full_precision_reason(g) is None)

    def full_precision_reason(self, group: LayerGroup) -> str | None:
        """Why ``group`` keeps full-precision K/V under ``kv_bits`` (None: it is quantized, or nothing is)."""
        if self.kv_bits is None:
            return None
        if group.state is not None:
            return "a recurrent state, not K/V per token"
        if self.latent:
            return "latent attention computes with the latents it fetches"
        if group.window is not None:
            return "a sliding window's ring is rewritten in place"
        if group.chunk is not None:
            return "a chunked window's run is laid out anew each chunk"
        if not self.geometry_of(group).quantizes(self.kv_bits, self.kv_group_size):
            geometry = self.geometry_of(group)
            return (f"head widths {geometry.head_dim}/{geometry.v_head_dim} split into no whole groups of "
                    f"{self.kv_group_size} at {self.kv_bits} bits")
        return None

    def with_hot_kv(self, bits: int | None, group_size: int = 64) -> "ModelCacheSpec":
        """This layout with the hot pool's K/V at ``bits`` (None: full precision) where a group can take it."""
        return replace(self, kv_bits=bits, kv_group_size=group_size)

    def hot_kv_summary(self) -> str:
        """The hot pool's K/V in a line: full precision, or the bits and what each group does."""
        if self.kv_bits is None:
            return "full precision"
        quantized = self.quantized_groups
        layers = sum(len(g.layers) for g in self.groups if g.index in quantized)
        kept = {reason: sum(len(g.layers) for g in self.groups if self.full_precision_reason(g) == reason)
                for g in self.groups if (reason := self.full_precision_reason(g)) is not None}
        parts = [f"{self.kv_bits}-bit in groups of {self.kv_group_size} on {layers} layers"]
        parts += [f"{n} layers full precision ({reason})" for reason, n in kept.items()]
        return "; ".join(parts)

    @property
    def block_bytes(self) -> int:
        """The pool's unit: every group's block is a whole number of them (the gcd of the block sizes)."""
        return reduce(math.gcd, (self.group_block_bytes(g) for g in self.groups))

    def group_units(self, group: LayerGroup) -> int:
        """Pool blocks one of ``group``'s blocks takes."""
        return self.group_block_bytes(group) // self.block_bytes

    @property
    def global_groups(self) -> tuple[LayerGroup, ...]:
        return tuple(g for g in self.groups if g.holds_every_position)

    @property
    def sliding_groups(self) -> tuple[LayerGroup, ...]:
        """Groups whose cache forgets (a sliding or a chunked window): checkpoints let them go back."""
        return tuple(g for g in self.groups if not g.holds_every_position)

    @property
    def is_hybrid(self) -> bool:
        return bool(self.sliding_groups) and bool(self.global_groups)

    def blocks_for_tokens(self, group: LayerGroup, n_tokens: int) -> int:
        """``group``'s blocks to hold a sequence of ``n_tokens`` tokens.

        A sliding-window group keeps at most its window plus the partial block
        at each end, so it never needs more than ``ceil(window / B) + 1``
        blocks. A chunked group is reserved whole, as full attention is, while a
        prompt is prefilled (it gives back what its chunk no longer needs after).
        """
        if n_tokens <= 0:
            return 0
        if group.is_recurrent:
            return 1
        whole = math.ceil(n_tokens / self.block_tokens)
        if group.window is None:
            return whole
        return min(whole, math.ceil(min(n_tokens, group.window) / self.block_tokens) + 1)

    def blocks_per_group_for_tokens(self, n_tokens: int) -> dict[int, int]:
        """Pool blocks per group to hold a sequence of ``n_tokens`` tokens."""
        return {g.index: self.blocks_for_tokens(g, n_tokens) * self.group_units(g) for g in self.groups}

    def total_blocks_for_tokens(self, n_tokens: int) -> int:
        """Pool blocks to hold a sequence of ``n_tokens`` tokens."""
        return sum(self.blocks_per_group_for_tokens(n_tokens).values())

    def bytes_for_tokens(self, n_tokens: int) -> int:
        return self.total_blocks_for_tokens(n_tokens) * self.block_bytes

    def layer_summary(self) -> str:
        """The layer groups in a line, for logs and ``semantic models``: each kind's layers, their geometry
        (K/V heads x widths) and bytes per token, e.g. ``global: 3 layers of 1x256/256 bfloat16 (1 KiB a token);
        sliding-512: 15 layers in 5 groups of 1x256/256 bfloat16 (1 KiB a token)``."""
        kinds: dict[tuple[str, object], list[LayerGroup]] = {}
        for g in self.groups:
            kinds.setdefault((g.kind, g.state or self.geometry_of(g)), []).append(g)
        parts = []
        for (kind, geometry), groups in kinds.items():
            layers = sum(len(g.layers) for g in groups)
            grouped = f" in {len(groups)} groups" if len(groups) > 1 else ""
            plural = "s" if layers != 1 else ""
            if isinstance(geometry, StateGeometry):
                parts.append(f"{kind}: {layers} layer{plural}{grouped} of {geometry.summary()} "
                             f"({_size(geometry.bytes * layers)} a sequence)")
                continue
            shape = f"{geometry.n_kv_heads}x{geometry.head_dim}/{geometry.v_head_dim} {geometry.dtype}"
            packed = f" at {self.kv_bits} bits" if groups[0].index in self.quantized_groups else ""
            parts.append(f"{kind}: {layers} layer{plural}{grouped} of {shape}{packed} "
                         f"({_size(self.group_token_bytes(groups[0]) * layers)} a token)")
        extras = [f"{len(self.shared_layers)} more layers read earlier layers' K/V"] if self.shared_layers else []
        extras += ["latent attention (one latent head per layer)"] if self.latent else []
        extras += [f"{len(self.cache_lists)} model layers keep two caches each"] if self.cache_lists else []
        return "; ".join(parts + extras)

    def describe(self) -> dict[str, object]:
        """JSON-friendly summary for stats, the model registry and cache files (whose fingerprint it is: a
        uniform model's is what it has always been). The layout's, at full precision: the hot pool's
        quantization is no part of it."""
        if self.kv_bits is not None:
            return replace(self, kv_bits=None).describe()
        groups: list[dict[str, object]] = []
        for g in self.groups:
            entry: dict[str, object] = {"index": g.index, "kind": g.kind, "layers": list(g.layers)}
            if g.state is not None:
                entry |= {"state": g.state.describe(), "block_bytes": self.group_block_bytes(g)}
            elif not self.is_uniform:
                entry |= {"geometry": self.geometry_of(g).describe(), "block_bytes": self.group_block_bytes(g)}
            groups.append(entry)
        out: dict[str, object] = {
            "n_layers": self.n_layers,
            "n_kv_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "v_head_dim": self.value_head_dim,
            "dtype": self.dtype,
            "block_tokens": self.block_tokens,
            "block_bytes": self.block_bytes,
            "groups": groups,
        }
        if self.shared_layers:
            out["shared_layers"] = list(self.shared_layers)
        if self.latent:
            out["latent"] = True
        if self.cache_lists:
            out["cache_lists"] = [list(entry) for entry in self.cache_lists]
        if self.shard is not None:
            out["shard"] = {"rank": self.shard[0], "world_size": self.shard[1]}
        return out


def _size(n_bytes: int) -> str:
    for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
        if n_bytes >= size:
            return f"{n_bytes / size:.3g} {unit}"
    return f"{n_bytes} B"


@dataclass(frozen=True, slots=True)
class LayerKind:
    """What one cache layer is, for grouping: full attention, a sliding window, or a chunked window, of a
    geometry (None: the model's own), or a recurrent layer's state."""

    window: int | None = None
    chunk: int | None = None
    geometry: KVGeometry | None = None
    state: StateGeometry | None = None


def group_layers(layer_windows: list[int | None] | list[LayerKind]) -> tuple[LayerGroup, ...]:
    """Partition layers into groups of one kind and geometry each, of equal size within a kind.

    The size within a kind is the gcd of the per-kind layer counts of the kinds
    of one geometry, so a 3-global / 15-sliding model gets groups of 3 and a
    uniform model one group; a kind of another geometry is split by its own count's
    gcd with its geometry's kinds. Full-attention groups come first, so group 0
    is the full-attention one when there is one.
    """
    if not layer_windows:
        raise ValueError("a model needs at least one layer")
    kinds = [k if isinstance(k, LayerKind) else LayerKind(window=k) for k in layer_windows]
    by_kind: dict[LayerKind, list[int]] = {}
    for layer, kind in enumerate(kinds):
        by_kind.setdefault(kind, []).append(layer)
    sizes: dict[object, int] = {}
    for kind, layers in by_kind.items():
        key = kind.state or kind.geometry
        sizes[key] = math.gcd(sizes.get(key, 0), len(layers))
    groups: list[LayerGroup] = []
    order = sorted(by_kind, key=lambda k: (k.state is not None, k.window is not None or k.chunk is not None,
                                           k.chunk or 0, k.window or 0, k.geometry is not None,
                                           k.state.bytes if k.state else 0))
    for kind in order:
        layers, size = by_kind[kind], sizes[kind.state or kind.geometry]
        for start in range(0, len(layers), size):
            groups.append(LayerGroup(len(groups), tuple(layers[start:start + size]), kind.window, kind.geometry,
                                     kind.chunk, kind.state))
    return tuple(groups)
