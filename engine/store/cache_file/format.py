"""The vocabulary of a cache file: constants, dtypes, records and the header's identity.

Every other ``cache_*`` module builds on these names, so this one does no I/O
and imports nothing of theirs. The file layout itself is described in
:mod:`engine.store.cache_file`.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from engine.domain.cache_spec import ModelCacheSpec
from engine.models.loaded import ModelIdentity

from engine.store.file_names import agent_file_stem

FORMAT_NAME = "semantic-agent-cache"
FORMAT_VERSION = 1
# Version 2: K/V quantized at rest (the header's ``kv_quantization``). A full-precision file is
# a version 1 file, so files of either kind keep loading.
QUANTIZED_FORMAT_VERSION = 2
READABLE_VERSIONS = (FORMAT_VERSION, QUANTIZED_FORMAT_VERSION)
# What mx.quantize offers; a reader checks a file's bits and group size against these.
QUANTIZATION_BITS = (2, 3, 4, 5, 6, 8)
QUANTIZATION_GROUP_SIZES = (32, 64, 128)
CHECKSUM_ALGORITHM = "crc32"
SUFFIX = ".safetensors"
QUARANTINE_DIR = "quarantine"
STALE_TEMP_SECONDS = 60.0
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
TOKENS = "token_ids"
CHECKPOINT_KINDS = ("turn", "prefix")

LENGTH = struct.Struct("<Q")
CRC_DIGITS = 8
CHECKSUM_PLACEHOLDER = f"{CHECKSUM_ALGORITHM}:{'0' * CRC_DIGITS}"
# The checksum is the last field of the header JSON, which is the last value
# of __metadata__, which is the table's last key: its digits always sit just
# before these closing bytes, so the writer can patch them in place.
AFTER_CHECKSUM = b'\\"}"}}'
CHECKSUM_VALUE = re.compile(r"crc32:[0-9a-f]{8}")
# A prefix file's key: lowercase hex, so it is also a safe file name.
PREFIX_KEY = re.compile(r"[0-9a-f]{1,64}")
_INDEX = r"(0|[1-9][0-9]{0,17})"
# A cache's own block "g{group}.b{start}.l{slot}.k", or a checkpoint's "c{i}.g...";
# a quantized K or V adds ".scales" and ".biases" next to its packed words.
BLOCK_NAME = re.compile(rf"(?:c{_INDEX}\.)?g{_INDEX}\.b{_INDEX}\.l{_INDEX}\.([kv])(?:\.(scales|biases))?")
# A recurrent group's state at a token position "g{group}.s{offset}.l{slot}.a{j}" (a snapshot's: "c{i}.g...").
STATE_NAME = re.compile(rf"(?:c{_INDEX}\.)?g{_INDEX}\.s{_INDEX}\.l{_INDEX}\.a{_INDEX}")
# The writer's temp files: ".{stem}.{pid}.{random hex}.tmp".
TEMP_NAME = re.compile(r"\.[A-Za-z0-9_-]+\.([1-9][0-9]{0,9})\.[0-9a-f]+\.tmp")


@dataclass(frozen=True, slots=True)
class Dtype:
    name: str
    code: str  # the safetensors spelling
    itemsize: int
    numpy: str  # what the reader returns: bfloat16 comes back as its uint16 bit pattern
    formats: frozenset[str]  # buffer-protocol formats the writer accepts


KV_DTYPES = {
    "float32": Dtype("float32", "F32", 4, "<f4", frozenset({"f", "<f"})),
    "float16": Dtype("float16", "F16", 2, "<f2", frozenset({"e", "<e"})),
    # "bfloat16" is MLX's buffer format; "H" the uint16 pattern a read record holds.
    "bfloat16": Dtype("bfloat16", "BF16", 2, "<u2", frozenset({"bfloat16", "H", "<H"})),
}
TOKEN_DTYPE = Dtype("uint32", "U32", 4, "<u4", frozenset({"I", "<I"}))
PACKED_DTYPE = TOKEN_DTYPE  # quantized K/V: mx.quantize's packed uint32 words
BY_CODE = {d.code: d for d in (*KV_DTYPES.values(), TOKEN_DTYPE)}


# -- records -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class KVQuantization:
    """How a file's K/V are quantized: ``mx.quantize`` along the head dimension."""

    bits: int
    group_size: int
    # The layer groups whose K/V are quantized (None: every group holding K/V). A hot pool quantizes only its
    # full-attention groups (``ModelCacheSpec.quantized_groups``), and its caches rest as it holds them.
    groups: tuple[int, ...] | None = None

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"bits": self.bits, "group_size": self.group_size}
        return out if self.groups is None else out | {"groups": list(self.groups)}

    def covers(self, group: int) -> bool:
        return self.groups is None or group in self.groups


class QuantizedArray(NamedTuple):
    """One quantized K or V as ``mx.quantize`` returns it: packed uint32 words, then per-group
    scales and biases in the spec's dtype (shape [1, kv_heads, length, head_dim / group_size])."""

    packed: Any
    scales: Any
    biases: Any


@dataclass(frozen=True, slots=True)
class PersistedBlock:
    """One block's K and V, one array per layer slot of the group.

    Arrays are anything with the buffer protocol: evaluated, C-contiguous
    mx.arrays when writing; numpy views of the file's bytes after reading.
    In a quantized record (the header's ``kv_quantization``) each is a
    :class:`QuantizedArray`. ``checkpoint`` is None for the cache's own blocks, ``i`` for a block of
    the header's ``checkpoints[i]``. A recurrent group's "block" is its state at token ``start``:
    ``length`` 0, no K/V, per layer slot its arrays in ``states`` (never quantized).
    """

    group: int
    start: int
    length: int
    keys: tuple[Any, ...]
    values: tuple[Any, ...]
    checkpoint: int | None = None
    states: tuple[tuple[Any, ...], ...] = ()

    @property
    def arrays(self) -> list[Any]:
        """Every array of the block (K and V, or a state's)."""
        return [*self.keys, *self.values, *(a for state in self.states for a in state)]

    @property
    def file_order(self) -> tuple[int, int, int]:
        """The cache's own blocks first, then each checkpoint's; by group, then start."""
        return (-1 if self.checkpoint is None else self.checkpoint, self.group, self.start)


@dataclass(frozen=True, slots=True)
class CacheHeader:
    format_version: int
    agent_id: str
    model_name: str
    model_digest: str
    spec_fingerprint: str
    spec: dict[str, Any]  # ModelCacheSpec.describe()
    cache_classes: list[str]  # per layer: "KVCache", "RotatingKVCache"
    cache_meta: list[dict[str, Any]]  # per layer, e.g. {"max_size": 512, "keep": 0}
    token_ids: list[int]
    n_tokens: int
    created_at: float
    last_used: float
    checksum: str = ""  # stamped by the writer
    tensor_bytes: int = 0  # K and V bytes; stamped by the writer
    display_name: str | None = None
    source: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # Earlier states of the sliding-window groups: {"offset": tokens, "kind": "turn" | "prefix"}.
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    # The shared prefix file whose first tokens stand in for the global groups'
    # own blocks: {"key": hex, "n_tokens": tokens}; None when the file holds them all.
    prefix: dict[str, Any] | None = None
    # {"bits": b, "group_size": g} when the K/V are quantized (format version 2); None: full precision.
    kv_quantization: dict[str, Any] | None = None

    @property
    def quantization(self) -> KVQuantization | None:
        q = self.kv_quantization
        if q is None:
            return None
        return KVQuantization(q["bits"], q["group_size"], tuple(q["groups"]) if "groups" in q else None)


@dataclass(frozen=True, slots=True)
class CacheRecord:
    header: CacheHeader
    blocks: tuple[PersistedBlock, ...]


@dataclass(frozen=True, slots=True)
class WrittenFile:
    path: Path
    nbytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class ScanResult:
    headers: list[tuple[Path, CacheHeader]]
    bad: list[tuple[Path, str]]


@dataclass(frozen=True, slots=True)
class Entry:
    """One tensor of the safetensors table: the writer lays these out, the reader parses them."""

    name: str
    dtype: str  # safetensors code
    shape: tuple[int, ...]
    begin: int  # offsets into the data section
    end: int


# -- identity ------------------------------------------------------------------------------
def new_header(
    agent_id: str,
    model: ModelIdentity,
    spec: ModelCacheSpec,
    token_ids: Sequence[int],
    cache_classes: Sequence[str],
    cache_meta: Sequence[dict[str, Any]],
    *,
    created_at: float | None = None,
    last_used: float | None = None,
    display_name: str | None = None,
    source: str | None = None,
    extra: dict[str, Any] | None = None,
    checkpoints: Sequence[dict[str, Any]] | None = None,
    prefix: dict[str, Any] | None = None,
    quantization: KVQuantization | None = None,
) -> CacheHeader:
    """A header ready for :func:`write_cache_file` (which stamps checksum and sizes)."""
    now = time.time()
    return CacheHeader(
        FORMAT_VERSION if quantization is None else QUANTIZED_FORMAT_VERSION, agent_id, model.name, model.digest, spec_fingerprint(spec),
        spec.describe(), list(cache_classes), [dict(m) for m in cache_meta],
        [int(t) for t in token_ids], len(token_ids),
        now if created_at is None else created_at, now if last_used is None else last_used,
        display_name=display_name, source=source, extra=dict(extra or {}),
        checkpoints=[dict(c) for c in checkpoints or ()],
        prefix=None if prefix is None else dict(prefix),
        kv_quantization=None if quantization is None else quantization.describe(),
    )


def spec_fingerprint(spec: ModelCacheSpec) -> str:
    return description_fingerprint(spec.describe())


def description_fingerprint(description: Any) -> str:
    canonical = json.dumps(description, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def cache_file_path(directory: Path, agent_id: str) -> Path:
    return directory / f"{agent_file_stem(agent_id)}{SUFFIX}"


def short_quote(value: object) -> str:
    """Error messages quote a corrupt file's values, but never more than a line of them."""
    text = str(value)
    return text if len(text) <= 80 else text[:77] + "..."
