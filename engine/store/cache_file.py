"""One agent's KV cache as one safetensors file, written and read without MLX.

Layout (plain safetensors, so ``mx.load`` and ``safetensors.safe_open`` read it):
an 8-byte little-endian header length, the JSON header padded with spaces so
tensor data starts 8-byte aligned, then the tensors' raw bytes in this order::

    token_ids                    U32 (n_tokens,)
    g{group}.b{start}.l{slot}.k  (1, kv_heads, length, head_dim)    per block, per layer slot
    g{group}.b{start}.l{slot}.v  (1, kv_heads, length, v_head_dim)

``__metadata__`` holds ``format: semantic-agent-cache`` and ``semantic``: the
:class:`CacheHeader` as one JSON string (safetensors metadata is str -> str).

Why the writer is hand-written: the safetensors package's numpy path cannot
express bfloat16 and joins every tensor into one bytes object (a full copy),
and ``mx.save_safetensors`` would run MLX on the I/O thread. Here each tensor
streams from its memoryview straight into the file.

Why token ids are a tensor: a 128K-token conversation is 512 KiB of uint32,
read with one ``np.frombuffer`` and covered by the checksum, instead of ~900 KB
of digits parsed into Python ints out of a JSON string inside a JSON string.
``token_ids`` comes first so :func:`read_header` reads one prefix of the file.

The checksum is crc32 (6.5 GB/s measured here against 1.3 GB/s for blake2b; it
guards against torn and flipped bytes, not against attackers). It covers every
byte of the file with its own 8 hex digits read as ``0``, the header included,
so a flipped agent id or rotating-cache offset is caught, not only flipped
tensor bytes. The writer computes it while streaming and patches the digits in
at the end: one pass over the data.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import re
import secrets
import stat
import struct
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, replace
from itertools import pairwise
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from engine.domain.block_layout import first_needed_position
from engine.domain.cache_spec import ModelCacheSpec
from engine.errors import CacheCorruptionError, CachePersistenceError
from engine.models.loaded import ModelIdentity

from .file_names import agent_file_stem

FORMAT_NAME = "semantic-agent-cache"
FORMAT_VERSION = 1
CHECKSUM_ALGORITHM = "crc32"
SUFFIX = ".safetensors"
QUARANTINE_DIR = "quarantine"
STALE_TEMP_SECONDS = 60.0
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
TOKENS = "token_ids"

_LENGTH = struct.Struct("<Q")
_CRC_DIGITS = 8
_CHECKSUM_PLACEHOLDER = f"{CHECKSUM_ALGORITHM}:{'0' * _CRC_DIGITS}"
# The checksum is the last field of the header JSON, which is the last value
# of __metadata__, which is the table's last key: its digits always sit just
# before these closing bytes, so the writer can patch them in place.
_AFTER_CHECKSUM = b'\\"}"}}'
_CHECKSUM_VALUE = re.compile(r"crc32:[0-9a-f]{8}")
_INDEX = r"(0|[1-9][0-9]{0,17})"
_BLOCK_NAME = re.compile(rf"g{_INDEX}\.b{_INDEX}\.l{_INDEX}\.([kv])")
_TEMP_NAME = re.compile(r"\.[A-Za-z0-9_-]+\.([1-9][0-9]{0,9})\.[0-9a-f]+\.tmp")


@dataclass(frozen=True, slots=True)
class _Dtype:
    name: str
    code: str  # the safetensors spelling
    itemsize: int
    numpy: str  # what the reader returns: bfloat16 comes back as its uint16 bit pattern
    formats: frozenset[str]  # buffer-protocol formats the writer accepts


_KV_DTYPES = {
    "float32": _Dtype("float32", "F32", 4, "<f4", frozenset({"f", "<f"})),
    "float16": _Dtype("float16", "F16", 2, "<f2", frozenset({"e", "<e"})),
    # "bfloat16" is MLX's buffer format; "H" the uint16 pattern a read record holds.
    "bfloat16": _Dtype("bfloat16", "BF16", 2, "<u2", frozenset({"bfloat16", "H", "<H"})),
}
_TOKEN_DTYPE = _Dtype("uint32", "U32", 4, "<u4", frozenset({"I", "<I"}))
_BY_CODE = {d.code: d for d in (*_KV_DTYPES.values(), _TOKEN_DTYPE)}


# -- records -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PersistedBlock:
    """One block's K and V, one array per layer slot of the group.

    Arrays are anything with the buffer protocol: evaluated, C-contiguous
    mx.arrays when writing; numpy views of the file's bytes after reading.
    """

    group: int
    start: int
    length: int
    keys: tuple[Any, ...]
    values: tuple[Any, ...]


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
) -> CacheHeader:
    """A header ready for :func:`write_cache_file` (which stamps checksum and sizes)."""
    now = time.time()
    return CacheHeader(
        FORMAT_VERSION, agent_id, model.name, model.digest, spec_fingerprint(spec),
        spec.describe(), list(cache_classes), [dict(m) for m in cache_meta],
        [int(t) for t in token_ids], len(token_ids),
        now if created_at is None else created_at, now if last_used is None else last_used,
        display_name=display_name, source=source, extra=dict(extra or {}),
    )


def spec_fingerprint(spec: ModelCacheSpec) -> str:
    return _fingerprint(spec.describe())


def _fingerprint(description: Any) -> str:
    canonical = json.dumps(description, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def cache_file_path(directory: Path, agent_id: str) -> Path:
    return directory / f"{agent_file_stem(agent_id)}{SUFFIX}"


# -- writing ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Source:
    name: str
    dtype: _Dtype
    shape: tuple[int, ...]
    data: memoryview  # the tensor's bytes, cast to "B"


@dataclass(frozen=True, slots=True)
class _Plan:
    head: bytes  # length prefix and padded JSON header, checksum digits still "0"
    checksum_at: int  # file offset of the checksum's hex digits
    sources: tuple[_Source, ...]
    nbytes: int


def write_cache_file(directory: Path, record: CacheRecord, *, sync: bool = True) -> WrittenFile:
    """Atomically write ``record`` to ``directory/{stem}.safetensors``.

    The bytes go to a unique temp file in the same directory, which is synced
    and then renamed over the final name, so a crash at any moment leaves the
    old file or the new one. ``sync=False`` skips the fsyncs: still atomic
    against process crashes, not against power loss. Raises ValueError for a
    record that would not read back, CachePersistenceError for any OS error.
    """
    started = time.perf_counter()
    plan = _plan(record)
    stem = agent_file_stem(record.header.agent_id)
    final = directory / f"{stem}{SUFFIX}"
    temp = directory / f".{stem}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _write_temp(temp, plan, sync)
        os.replace(temp, final)
    except BaseException as err:
        _remove_quietly(temp)
        if isinstance(err, OSError):
            raise CachePersistenceError(f"cannot write warm cache {final}: {err}") from err
        raise
    if sync:
        _sync_directory(directory)
    return WrittenFile(final, plan.nbytes, time.perf_counter() - started)


def _open_exclusive(path: Path) -> BinaryIO:
    return open(path, "xb")


def _write_temp(temp: Path, plan: _Plan, sync: bool) -> None:
    with _open_exclusive(temp) as out:
        crc = zlib.crc32(plan.head)
        out.write(plan.head)
        for source in plan.sources:
            crc = zlib.crc32(source.data, crc)
            out.write(source.data)
        out.seek(plan.checksum_at)
        out.write(f"{crc:08x}".encode("ascii"))
        out.flush()
        if sync:
            _sync_file(out.fileno())


def _sync_file(fd: int) -> None:
    # On macOS fsync stops at the drive's cache; F_FULLFSYNC asks it to persist.
    full_sync = getattr(fcntl, "F_FULLFSYNC", None)
    if full_sync is not None:
        with suppress(OSError):  # file systems without it fall back to fsync
            fcntl.fcntl(fd, full_sync)
            return
    os.fsync(fd)


def _sync_directory(directory: Path) -> None:
    """Make the rename durable. Best effort: if it is lost, the old whole file remains."""
    with suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _remove_quietly(path: Path) -> None:
    with suppress(OSError):
        path.unlink()


def _plan(record: CacheRecord) -> _Plan:
    header = record.header
    try:
        geometry = _geometry(header.spec)
        sources = [_token_source(header.token_ids), *_block_sources(record.blocks, geometry.dtype)]
        entries = _lay_out(sources)
        header = replace(header, format_version=FORMAT_VERSION, checksum=_CHECKSUM_PLACEHOLDER,
                         tensor_bytes=sum(e.end - e.begin for e in entries[1:]))
        _token_entry(_by_name(entries), header.n_tokens)
        _check_blocks(geometry, _by_name(entries), header)
        head, checksum_at = _encode_head(header, entries)
    except CacheCorruptionError as err:
        raise ValueError(f"refusing to write a cache that would not read back: {err}") from None
    return _Plan(head, checksum_at, tuple(sources), len(head) + entries[-1].end)


def _token_source(token_ids: Sequence[int]) -> _Source:
    tokens = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**32):
        raise ValueError("token ids must fit uint32")
    return _source(TOKENS, tokens.astype("<u4"), _TOKEN_DTYPE)


def _block_sources(blocks: Sequence[PersistedBlock], dtype: _Dtype) -> list[_Source]:
    sources = []
    for block in sorted(blocks, key=lambda b: (b.group, b.start)):
        for slot, (k, v) in enumerate(zip(block.keys, block.values)):
            prefix = f"g{block.group}.b{block.start}.l{slot}"
            sources += [_source(f"{prefix}.k", k, dtype), _source(f"{prefix}.v", v, dtype)]
            if {sources[-1].shape[2:3], sources[-2].shape[2:3]} != {(block.length,)}:
                raise ValueError(f"{prefix}: arrays do not hold the block's {block.length} tokens")
    return sources


def _source(name: str, array: Any, dtype: _Dtype) -> _Source:
    view = memoryview(array)
    if view.format not in dtype.formats or view.itemsize != dtype.itemsize:
        raise ValueError(f"tensor {name}: buffer format {view.format!r} is not {dtype.name}")
    if not view.c_contiguous:
        raise ValueError(f"tensor {name} is not C-contiguous")
    return _Source(name, dtype, tuple(view.shape), view.cast("B"))


def _lay_out(sources: Sequence[_Source]) -> list[_Entry]:
    entries, position = [], 0
    for source in sources:
        end = position + source.data.nbytes
        entries.append(_Entry(source.name, source.dtype.code, source.shape, position, end))
        position = end
    if len({e.name for e in entries}) != len(entries):
        raise ValueError("two blocks of one group start at the same position")
    return entries


def _by_name(entries: Sequence[_Entry]) -> dict[str, _Entry]:
    return {e.name: e for e in entries}


def _encode_head(header: CacheHeader, entries: Sequence[_Entry]) -> tuple[bytes, int]:
    table: dict[str, Any] = {
        e.name: {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [e.begin, e.end]}
        for e in entries
    }
    fields = {name: getattr(header, name) for name in _HEADER_FIELDS if name != "checksum"}
    fields["checksum"] = header.checksum  # last: see _AFTER_CHECKSUM
    semantic = json.dumps(fields, allow_nan=False, separators=(",", ":"))
    _check_fields(json.loads(semantic))  # what the reader will see
    table["__metadata__"] = {"format": FORMAT_NAME, "semantic": semantic}
    text = json.dumps(table, separators=(",", ":")).encode("ascii")
    # Spaces pad the header so tensor data starts 8-byte aligned, as safetensors does.
    padded = text + b" " * (-(_LENGTH.size + len(text)) % 8)
    checksum_at = _LENGTH.size + len(text) - len(_AFTER_CHECKSUM) - _CRC_DIGITS
    return _LENGTH.pack(len(padded)) + padded, checksum_at


# -- reading ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Entry:
    name: str
    dtype: str  # safetensors code
    shape: tuple[int, ...]
    begin: int  # offsets into the data section
    end: int


@dataclass(frozen=True, slots=True)
class _Layout:
    header: CacheHeader  # token_ids not read yet
    entries: dict[str, _Entry]
    head: bytes  # length prefix and JSON header as read: the checksum starts here
    checksum_at: int
    tokens: _Entry


def read_header(path: Path) -> CacheHeader:
    """The header and token ids, reading only the start of the file.

    Checks the structure, not the checksum: that needs every byte, and
    :func:`read_cache_file` checks it before anything is restored.
    """
    with _reading(path), _open_regular(path) as (src, size):
        layout = _read_layout(src, size)
        src.seek(len(layout.head) + layout.tokens.begin)
        raw = _read_exact(src, layout.tokens.end - layout.tokens.begin, "the token ids")
    return replace(layout.header, token_ids=np.frombuffer(raw, "<u4").tolist())


def read_cache_file(
    path: Path, expect_model_digest: str, expect_spec_fingerprint: str,
    *, expect_model_name: str | None = None,
) -> CacheRecord:
    """Read and validate a whole cache file; any defect raises CacheCorruptionError."""
    with _reading(path), _open_regular(path) as (src, size):
        layout = _read_layout(src, size)
        header = layout.header
        _check_identity(header, expect_model_digest, expect_spec_fingerprint, expect_model_name)
        geometry = _geometry(header.spec)
        runs = _check_blocks(geometry, layout.entries, header)
        data = _read_data(src, len(layout.head), size - len(layout.head))
        _check_checksum(layout, data)
    data.flags.writeable = False  # blocks are immutable; every array below is a view of this
    tokens = _view(data, layout.tokens, _TOKEN_DTYPE)
    blocks = tuple(
        PersistedBlock(b.group, b.start, b.length,
                       tuple(_view(data, e, geometry.dtype) for e in b.keys),
                       tuple(_view(data, e, geometry.dtype) for e in b.values))
        for group in sorted(runs) for b in runs[group]
    )
    return CacheRecord(replace(header, token_ids=tokens.tolist()), blocks)


@contextmanager
def _reading(path: Path) -> Iterator[None]:
    """Every failure to read ``path`` becomes a CacheCorruptionError naming it."""
    try:
        yield
    except CacheCorruptionError as err:
        raise CacheCorruptionError(f"{path}: {err}") from None
    except OSError as err:
        raise CacheCorruptionError(f"{path}: unreadable ({err.strerror or err})") from None


@contextmanager
def _open_regular(path: Path) -> Iterator[tuple[BinaryIO, int]]:
    # Checked before opening: opening a FIFO would block the I/O thread.
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise CacheCorruptionError("not a regular file")
    with open(path, "rb") as src:
        yield src, os.fstat(src.fileno()).st_size


def _read_exact(src: BinaryIO, n: int, what: str) -> bytes:
    data = src.read(n)
    if len(data) != n:
        raise CacheCorruptionError(f"truncated while reading {what}")
    return data


def _read_layout(src: BinaryIO, size: int) -> _Layout:
    json_len = _header_length(src, size)
    head = _LENGTH.pack(json_len) + _read_exact(src, json_len, "the header")
    table = _parse_json(head[_LENGTH.size:], "header")
    if type(table) is not dict:
        raise CacheCorruptionError("bad JSON header: not an object")
    header = _parse_header(table.get("__metadata__"))
    entries = {
        name: _parse_entry(name, desc) for name, desc in table.items() if name != "__metadata__"
    }
    _check_offsets(entries.values(), size - len(head))
    checksum_at = _checksum_offset(head, header.checksum)
    return _Layout(header, entries, head, checksum_at, _token_entry(entries, header.n_tokens))


def _header_length(src: BinaryIO, size: int) -> int:
    if size < _LENGTH.size:
        raise CacheCorruptionError(f"truncated: {size} bytes, too short for the header length")
    (n,) = _LENGTH.unpack(_read_exact(src, _LENGTH.size, "the header length"))
    if n < 2 or n > MAX_HEADER_BYTES:
        raise CacheCorruptionError(f"header length {n} is absurd")
    if n > size - _LENGTH.size:
        raise CacheCorruptionError(
            f"truncated: the header claims {n} bytes, {size - _LENGTH.size} follow")
    return n


def _parse_json(text: bytes | str, what: str) -> Any:
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as err:
        raise CacheCorruptionError(f"bad JSON {what}: {_short(err)}") from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    table = dict(pairs)
    if len(table) != len(pairs):
        raise ValueError("duplicate keys")
    return table


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


def _short(value: object) -> str:
    text = str(value)
    return text if len(text) <= 80 else text[:77] + "..."


# -- validating the header -------------------------------------------------------------------
def _is_str(v: Any) -> bool:
    return type(v) is str


def _is_count(v: Any) -> bool:
    return type(v) is int and v >= 0


def _is_time(v: Any) -> bool:
    # Checked by type first: math.isfinite overflows on huge ints.
    return (type(v) is int and abs(v) < 2**63) or (type(v) is float and math.isfinite(v))


def _is_optional_str(v: Any) -> bool:
    return v is None or type(v) is str


def _is_dict(v: Any) -> bool:
    return type(v) is dict


def _is_list_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: type(v) is list and all(check(x) for x in v)


# The header's JSON fields, in the order written; token ids travel as a tensor.
_HEADER_FIELDS = {
    "format_version": _is_count, "agent_id": _is_str, "model_name": _is_str,
    "model_digest": _is_str, "spec_fingerprint": _is_str, "spec": _is_dict,
    "cache_classes": _is_list_of(_is_str), "cache_meta": _is_list_of(_is_dict),
    "n_tokens": _is_count, "created_at": _is_time, "last_used": _is_time,
    "tensor_bytes": _is_count, "display_name": _is_optional_str, "source": _is_optional_str,
    "extra": _is_dict, "checksum": _is_str,
}


def _parse_header(metadata: Any) -> CacheHeader:
    if type(metadata) is not dict or "format" not in metadata:
        raise CacheCorruptionError("no format in the metadata: not a semantic agent cache")
    if metadata["format"] != FORMAT_NAME:
        raise CacheCorruptionError(
            f"unknown format {_short(repr(metadata['format']))}, expected {FORMAT_NAME!r}")
    if type(metadata.get("semantic")) is not str:
        raise CacheCorruptionError("no semantic header in the metadata")
    fields = _parse_json(metadata["semantic"], "semantic header")
    if type(fields) is not dict:
        raise CacheCorruptionError("bad JSON semantic header: not an object")
    version = fields.get("format_version")
    if type(version) is not int or version != FORMAT_VERSION:
        raise CacheCorruptionError(
            f"unsupported format_version {_short(repr(version))} "
            f"(this build reads {FORMAT_VERSION})")
    _check_fields(fields)
    fields["created_at"] = float(fields["created_at"])
    fields["last_used"] = float(fields["last_used"])
    return CacheHeader(token_ids=[], **fields)


def _check_fields(fields: dict[str, Any]) -> None:
    missing = sorted(set(_HEADER_FIELDS) - set(fields))
    unknown = sorted(set(fields) - set(_HEADER_FIELDS))
    if missing or unknown:
        raise CacheCorruptionError(f"header fields missing {missing}, unknown {_short(unknown)}")
    for name, valid in _HEADER_FIELDS.items():
        if not valid(fields[name]):
            raise CacheCorruptionError(
                f"header field {name} has a bad value {_short(repr(fields[name]))}")
    if not _CHECKSUM_VALUE.fullmatch(fields["checksum"]):
        raise CacheCorruptionError(
            f"unsupported checksum {_short(repr(fields['checksum']))}, "
            f"expected {CHECKSUM_ALGORITHM}")


def _parse_entry(name: str, desc: Any) -> _Entry:
    tensor = f"tensor {_short(repr(name))}"
    if type(desc) is not dict or set(desc) != {"dtype", "shape", "data_offsets"}:
        raise CacheCorruptionError(f"{tensor} has a malformed entry")
    dtype, shape, offsets = desc["dtype"], desc["shape"], desc["data_offsets"]
    if type(dtype) is not str or dtype not in _BY_CODE:
        raise CacheCorruptionError(f"{tensor} has unexpected dtype {_short(repr(dtype))}")
    if not _is_list_of(_is_count)(shape) or len(shape) > 8:
        raise CacheCorruptionError(f"{tensor} has a bad shape {_short(shape)}")
    if not _is_list_of(_is_count)(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
        raise CacheCorruptionError(f"{tensor} has bad data_offsets {_short(offsets)}")
    needed, span = math.prod(shape) * _BY_CODE[dtype].itemsize, offsets[1] - offsets[0]
    if span != needed:
        raise CacheCorruptionError(
            f"{tensor}: {dtype} {shape} needs {needed} bytes, its data_offsets span {span}")
    return _Entry(name, dtype, tuple(shape), offsets[0], offsets[1])


def _check_offsets(entries: Iterable[_Entry], data_len: int) -> None:
    """Tensors must tile the data section exactly: no overlap, no gap, nothing past the end."""
    position = 0
    for entry in sorted(entries, key=lambda e: (e.begin, e.end)):
        if entry.begin < position:
            raise CacheCorruptionError(
                f"tensor {_short(repr(entry.name))} at bytes [{entry.begin}, {entry.end}) "
                f"overlaps the tensor ending at {position}")
        if entry.begin > position:
            raise CacheCorruptionError(
                f"data bytes [{position}, {entry.begin}) belong to no tensor")
        position = entry.end
    if position > data_len:
        raise CacheCorruptionError(
            f"truncated: the tensors need {position} bytes of data, the file holds {data_len}")
    if position < data_len:
        raise CacheCorruptionError(f"{data_len - position} trailing bytes after the last tensor")


def _checksum_offset(head: bytes, checksum: str) -> int:
    body = head.rstrip(b" ")
    if not body.endswith(checksum.encode("ascii") + _AFTER_CHECKSUM):
        raise CacheCorruptionError("the checksum is not the header's last field")
    return len(body) - len(_AFTER_CHECKSUM) - _CRC_DIGITS


def _token_entry(entries: dict[str, _Entry], n_tokens: int) -> _Entry:
    entry = entries.get(TOKENS)
    if entry is None:
        raise CacheCorruptionError("no token_ids tensor")
    if entry.dtype != _TOKEN_DTYPE.code or entry.shape != (n_tokens,):
        raise CacheCorruptionError(
            f"token_ids is {entry.dtype} {list(entry.shape)}, the header needs U32 [{n_tokens}]")
    return entry


def _check_identity(
    header: CacheHeader, digest: str, fingerprint: str, model_name: str | None
) -> None:
    if header.model_digest != digest:
        made_by = f"{header.model_name}@{header.model_digest[:16]}"
        raise CacheCorruptionError(
            f"cache made by model {made_by}, loaded model is {model_name or ''}@{digest[:16]}")
    if _fingerprint(header.spec) != header.spec_fingerprint:
        raise CacheCorruptionError("the header's spec does not match its own fingerprint")
    if header.spec_fingerprint != fingerprint:
        raise CacheCorruptionError(
            f"spec fingerprint mismatch: cache {header.spec_fingerprint[:16]}, "
            f"loaded model {fingerprint[:16]} (block size, KV dtype or layer grouping changed)")


def _read_data(src: BinaryIO, data_start: int, data_len: int) -> np.ndarray:
    data = np.empty(data_len, dtype=np.uint8)
    view = memoryview(data)
    src.seek(data_start)
    filled = 0
    while filled < data_len:
        got = src.readinto(view[filled:])
        if not got:
            raise CacheCorruptionError("truncated while reading tensor data")
        filled += got
    return data


def _check_checksum(layout: _Layout, data: np.ndarray) -> None:
    head = bytearray(layout.head)
    head[layout.checksum_at : layout.checksum_at + _CRC_DIGITS] = b"0" * _CRC_DIGITS
    actual = f"{CHECKSUM_ALGORITHM}:{zlib.crc32(data, zlib.crc32(head)):08x}"
    if actual != layout.header.checksum:
        raise CacheCorruptionError(
            f"checksum mismatch: header says {layout.header.checksum}, contents give {actual}")


def _view(data: np.ndarray, entry: _Entry, dtype: _Dtype) -> np.ndarray:
    return data[entry.begin : entry.end].view(dtype.numpy).reshape(entry.shape)


# -- validating tensors against the spec ------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Geometry:
    n_layers: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype: _Dtype
    block_tokens: int
    groups: dict[int, tuple[int, int | None]]  # group index -> (layers in it, sliding window)


@dataclass(frozen=True, slots=True)
class _BlockEntries:
    group: int
    start: int
    length: int
    keys: tuple[_Entry, ...]
    values: tuple[_Entry, ...]

    @property
    def end(self) -> int:
        return self.start + self.length


def _geometry(spec: dict[str, Any]) -> _Geometry:
    """The shape facts of a ``ModelCacheSpec.describe()`` dict."""
    try:
        groups = {g["index"]: (len(g["layers"]), _window(g["kind"])) for g in spec["groups"]}
        return _Geometry(spec["n_layers"], spec["n_kv_heads"], spec["head_dim"], spec["v_head_dim"],
                         _KV_DTYPES[spec["dtype"]], spec["block_tokens"], groups)
    except (KeyError, TypeError, ValueError) as err:
        raise CacheCorruptionError(
            f"spec is malformed or unsupported ({_short(repr(err))})") from None


def _window(kind: str) -> int | None:
    return None if kind == "global" else int(kind.removeprefix("sliding-"))


def _check_blocks(
    geometry: _Geometry, entries: dict[str, _Entry], header: CacheHeader
) -> dict[int, list[_BlockEntries]]:
    """Every tensor is a K or V of a whole block, and each group's blocks cover the cache."""
    layers = {len(header.cache_classes), len(header.cache_meta)}
    if layers != {geometry.n_layers}:
        raise CacheCorruptionError(f"header describes {sorted(layers)} layer caches, "
                                   f"the spec has {geometry.n_layers} layers")
    runs = _group_blocks(geometry, entries)
    for index, (_, window) in geometry.groups.items():
        _check_run(index, runs.get(index, []), header.n_tokens, window)
    kv_bytes = sum(e.end - e.begin for name, e in entries.items() if name != TOKENS)
    if kv_bytes != header.tensor_bytes:
        raise CacheCorruptionError(
            f"header says {header.tensor_bytes} tensor bytes, the tensors hold {kv_bytes}")
    return runs


def _group_blocks(
    geometry: _Geometry, entries: dict[str, _Entry]
) -> dict[int, list[_BlockEntries]]:
    found: dict[tuple[int, int], dict[tuple[int, str], _Entry]] = {}
    for name, entry in entries.items():
        if name == TOKENS:
            continue
        match = _BLOCK_NAME.fullmatch(name)
        if match is None:
            raise CacheCorruptionError(f"unexpected tensor {_short(repr(name))}")
        group, start, slot = int(match[1]), int(match[2]), int(match[3])
        found.setdefault((group, start), {})[(slot, match[4])] = entry
    runs: dict[int, list[_BlockEntries]] = {}
    for (group, start), tensors in sorted(found.items()):
        runs.setdefault(group, []).append(_block(geometry, group, start, tensors))
    return runs


def _block(
    geometry: _Geometry, group: int, start: int, tensors: dict[tuple[int, str], _Entry]
) -> _BlockEntries:
    if group not in geometry.groups:
        raise CacheCorruptionError(
            f"tensor group {group} is not in the spec (groups {sorted(geometry.groups)})")
    width = geometry.groups[group][0]
    if set(tensors) != {(slot, kind) for slot in range(width) for kind in "kv"}:
        raise CacheCorruptionError(
            f"block g{group}.b{start} lacks k or v of some of the group's {width} layers")
    keys = tuple(tensors[(slot, "k")] for slot in range(width))
    values = tuple(tensors[(slot, "v")] for slot in range(width))
    lengths = {_tensor_length(geometry, e, geometry.head_dim) for e in keys}
    lengths |= {_tensor_length(geometry, e, geometry.v_head_dim) for e in values}
    length = min(lengths)
    room = geometry.block_tokens - start % geometry.block_tokens  # blocks sit on boundaries
    if len(lengths) != 1 or not 1 <= length <= room:
        raise CacheCorruptionError(f"block g{group}.b{start} holds {sorted(lengths)} tokens, "
                                   f"which does not fit one {geometry.block_tokens}-token block")
    return _BlockEntries(group, start, length, keys, values)


def _tensor_length(geometry: _Geometry, entry: _Entry, head_dim: int) -> int:
    if entry.dtype != geometry.dtype.code:
        raise CacheCorruptionError(f"tensor {entry.name} has unexpected dtype {entry.dtype}, "
                                   f"the spec stores {geometry.dtype.name}")
    shape = entry.shape
    if len(shape) != 4 or shape[0] != 1 or shape[1] != geometry.kv_heads or shape[3] != head_dim:
        raise CacheCorruptionError(f"tensor {entry.name} has shape {list(shape)}, "
                                   f"the spec needs [1, {geometry.kv_heads}, n, {head_dim}]")
    return shape[2]


def _check_run(index: int, run: list[_BlockEntries], n_tokens: int, window: int | None) -> None:
    for before, after in pairwise(run):
        if after.start != before.end:
            raise CacheCorruptionError(f"group {index} is not contiguous: a block starts at "
                                       f"{after.start} after one ending at {before.end}")
    end = run[-1].end if run else 0
    if end != n_tokens:
        raise CacheCorruptionError(
            f"group {index} covers tokens up to {end}, the cache holds {n_tokens}")
    needed = first_needed_position(n_tokens, window)
    if run and run[0].start > needed:
        raise CacheCorruptionError(
            f"group {index} starts at token {run[0].start}, but must hold token {needed} on")


# -- the directory ---------------------------------------------------------------------------
def scan_directory(directory: Path) -> ScanResult:
    """Headers of every cache file, for start-up indexing; bad files are listed, not touched.

    Also removes temp files that crashed writers left behind.
    """
    try:
        names = sorted(os.listdir(directory)) if directory.is_dir() else []
    except OSError as err:
        raise CachePersistenceError(f"cannot list warm cache directory {directory}: {err}") from err
    _remove_stale_temps(directory, names)
    result = ScanResult([], [])
    for name in names:
        if name.endswith(SUFFIX) and not name.startswith("."):
            try:
                result.headers.append((directory / name, read_header(directory / name)))
            except CacheCorruptionError as err:
                result.bad.append((directory / name, str(err)))
    return result


def _remove_stale_temps(directory: Path, names: list[str]) -> None:
    now = time.time()
    for name in names:
        match = _TEMP_NAME.fullmatch(name)
        if match is None:
            continue
        path = directory / name
        with suppress(OSError):
            # A live writer keeps touching its file; one idle for a minute is dead
            # even if its pid has since been reused.
            if not _pid_alive(int(match[1])) or now - path.stat().st_mtime > STALE_TEMP_SECONDS:
                path.unlink()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, owned by another user
    except (OSError, OverflowError):
        return False
    return True


def quarantine(path: Path, reason: str) -> Path | None:
    """Move a bad cache file into ``quarantine/`` with a ``.reason.txt`` beside it.

    Deletes it when it cannot be moved; returns where it went, or None. Never raises.
    """
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = path.parent / QUARANTINE_DIR / f"{stamp}-{secrets.token_hex(3)}-{path.name}"
    try:
        target.parent.mkdir(exist_ok=True)
        os.replace(path, target)
    except OSError:
        _remove_quietly(path)
        return None
    with suppress(OSError):
        reason_file = target.with_name(target.name + ".reason.txt")
        reason_file.write_text(reason + "\n", encoding="utf-8", errors="backslashreplace")
    return target
