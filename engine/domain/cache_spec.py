"""The KV-cache layout of a model, independent of MLX.

Layers are partitioned into *layer groups* of equal size so every block of the
pool has the same byte size (the vLLM v1 hybrid-allocator idea): a uniform
model is one group of all its layers; a hybrid sliding-window model such as
Gemma 3 (3 global + 15 sliding layers) becomes 1 global group and 5 sliding
groups of 3 layers each. One block = ``block_tokens`` tokens of K and V for
every layer of one group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int8": 1,
    "uint8": 1,
}


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Layers that share one block table. ``window`` is None for full attention."""

    index: int
    layers: tuple[int, ...]
    window: int | None = None

    @property
    def is_sliding(self) -> bool:
        return self.window is not None

    @property
    def kind(self) -> str:
        return f"sliding-{self.window}" if self.window else "global"


@dataclass(frozen=True, slots=True)
class ModelCacheSpec:
    """Per-model KV layout: what one block holds and how many bytes it costs."""

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
        sizes = {len(g.layers) for g in self.groups}
        if len(sizes) != 1:
            raise ValueError(f"layer groups must have equal sizes, got {sorted(sizes)}")

    # -- sizes ------------------------------------------------------------------
    @property
    def layers_per_group(self) -> int:
        return len(self.groups[0].layers)

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim if self.v_head_dim is not None else self.head_dim

    @property
    def bytes_per_token_per_layer(self) -> int:
        return self.n_kv_heads * (self.head_dim + self.value_head_dim) * DTYPE_BYTES[self.dtype]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: K and V of ``block_tokens`` tokens for one group's layers."""
        return self.bytes_per_token_per_layer * self.layers_per_group * self.block_tokens

    @property
    def global_groups(self) -> tuple[LayerGroup, ...]:
        return tuple(g for g in self.groups if not g.is_sliding)

    @property
    def sliding_groups(self) -> tuple[LayerGroup, ...]:
        return tuple(g for g in self.groups if g.is_sliding)

    @property
    def is_hybrid(self) -> bool:
        return bool(self.sliding_groups) and bool(self.global_groups)

    def blocks_for_tokens(self, group: LayerGroup, n_tokens: int) -> int:
        """Blocks ``group`` needs to hold a sequence of ``n_tokens`` tokens.

        A sliding-window group keeps at most its window plus the partial block
        at each end, so it never needs more than ``ceil(window / B) + 1`` blocks.
        """
        if n_tokens <= 0:
            return 0
        if group.window is None:
            return math.ceil(n_tokens / self.block_tokens)
        held = min(n_tokens, group.window)
        return min(math.ceil(n_tokens / self.block_tokens), math.ceil(held / self.block_tokens) + 1)

    def blocks_per_group_for_tokens(self, n_tokens: int) -> dict[int, int]:
        return {g.index: self.blocks_for_tokens(g, n_tokens) for g in self.groups}

    def total_blocks_for_tokens(self, n_tokens: int) -> int:
        return sum(self.blocks_per_group_for_tokens(n_tokens).values())

    def bytes_for_tokens(self, n_tokens: int) -> int:
        return self.total_blocks_for_tokens(n_tokens) * self.block_bytes

    def describe(self) -> dict[str, object]:
        """JSON-friendly summary for stats and the model registry."""
        return {
            "n_layers": self.n_layers,
            "n_kv_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "v_head_dim": self.value_head_dim,
            "dtype": self.dtype,
            "block_tokens": self.block_tokens,
            "block_bytes": self.block_bytes,
            "groups": [
                {"index": g.index, "kind": g.kind, "layers": list(g.layers)} for g in self.groups
            ],
        } | ({} if self.shard is None else {"shard": {"rank": self.shard[0], "world_size": self.shard[1]}})


def group_layers(layer_windows: list[int | None]) -> tuple[LayerGroup, ...]:
    """Partition layers into equal-sized groups of one attention kind each.

    The group size is the gcd of the per-kind layer counts, so a 3-global /
    15-sliding model gets groups of 3 and a uniform model one group.
    """
    if not layer_windows:
        raise ValueError("a model needs at least one layer")
    by_kind: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        by_kind.setdefault(window, []).append(layer)
    size = 0
    for layers in by_kind.values():
        size = math.gcd(size, len(layers))
    groups: list[LayerGroup] = []
    # Global groups first so group 0 is the full-attention one when present.
    for window in sorted(by_kind, key=lambda w: (w is not None, w or 0)):
        layers = by_kind[window]
        for start in range(0, len(layers), size):
            groups.append(LayerGroup(len(groups), tuple(layers[start : start + size]), window))
    return tuple(groups)
