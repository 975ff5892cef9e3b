"""Reading a cache file back: the header alone for indexing, or the whole validated record.

The reader runs on the I/O thread and never imports MLX: it returns numpy
views of one read-only buffer, which ``to_mlx`` copies into MLX on the engine
thread. Every defect, an OS error included, becomes one CacheCorruptionError
naming the file, so callers have a single failure to handle (quarantine it).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO

import numpy as np

from engine.errors import CacheCorruptionError

from engine.store.cache_file.format import (
    LENGTH,
    BY_CODE,
    PACKED_DTYPE,
    TOKEN_DTYPE,
    MAX_HEADER_BYTES,
    CacheHeader,
    CacheRecord,
    PersistedBlock,
    QuantizedArray,
    Dtype,
    Entry,
)
from engine.store.cache_file.header import checksum_offset, parse_entry, parse_header, parse_json
from engine.store.cache_file.validation import (
    BlockEntries,
    check_blocks,
    check_checksum,
    check_identity,
    check_offsets,
    spec_geometry,
    Runs,
    token_entry,
)


@dataclass(frozen=True, slots=True)
class _Layout:
    header: CacheHeader  # token_ids not read yet
    entries: dict[str, Entry]
    head: bytes  # length prefix and JSON header as read: the checksum starts here
    checksum_at: int
    tokens: Entry


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
        check_identity(header, expect_model_digest, expect_spec_fingerprint, expect_model_name)
        geometry = spec_geometry(header.spec)
        runs = check_blocks(geometry, layout.entries, header)
        data = _read_data(src, len(layout.head), size - len(layout.head))
        check_checksum(layout.head, layout.checksum_at, header.checksum, data)
    data.flags.writeable = False  # blocks are immutable; every array below is a view of this
    tokens = _view(data, layout.tokens, TOKEN_DTYPE)
    def array(entry: Entry | QuantizedArray) -> np.ndarray | QuantizedArray:
        if isinstance(entry, QuantizedArray):
            return QuantizedArray(_view(data, entry.packed, PACKED_DTYPE), _view(data, entry.scales, geometry.dtype),
                                  _view(data, entry.biases, geometry.dtype))
        return _view(data, entry, geometry.dtype)

    blocks = tuple(
        PersistedBlock(b.group, b.start, b.length, tuple(array(e) for e in b.keys),
                       tuple(array(e) for e in b.values), b.checkpoint,
                       tuple(tuple(_view(data, e, BY_CODE[e.dtype]) for e in state) for state in b.states))
        for b in _in_file_order(runs)
    )
    return CacheRecord(replace(header, token_ids=tokens.tolist()), blocks)


def _in_file_order(runs: Runs) -> Iterator[BlockEntries]:
    """The cache's own blocks, then each checkpoint's; by group, then start."""
    for checkpoint in sorted(runs, key=lambda i: -1 if i is None else i):
        for group in sorted(runs[checkpoint]):
            yield from runs[checkpoint][group]


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
    """The parsed header and tensor table, checked against the file's size."""
    json_len = _header_length(src, size)
    head = LENGTH.pack(json_len) + _read_exact(src, json_len, "the header")
    table = parse_json(head[LENGTH.size:], "header")
    if type(table) is not dict:
        raise CacheCorruptionError("bad JSON header: not an object")
    header = parse_header(table.get("__metadata__"))
    entries = {
        name: parse_entry(name, desc) for name, desc in table.items() if name != "__metadata__"
    }
    check_offsets(entries.values(), size - len(head))
    checksum_at = checksum_offset(head, header.checksum)
    return _Layout(header, entries, head, checksum_at, token_entry(entries, header.n_tokens))


def _header_length(src: BinaryIO, size: int) -> int:
    if size < LENGTH.size:
        raise CacheCorruptionError(f"truncated: {size} bytes, too short for the header length")
    (n,) = LENGTH.unpack(_read_exact(src, LENGTH.size, "the header length"))
    if n < 2 or n > MAX_HEADER_BYTES:
        raise CacheCorruptionError(f"header length {n} is absurd")
    if n > size - LENGTH.size:
        raise CacheCorruptionError(
            f"truncated: the header claims {n} bytes, {size - LENGTH.size} follow")
    return n


def _read_data(src: BinaryIO, data_start: int, data_len: int) -> np.ndarray:
    """The whole data section in one buffer, so every tensor can be a view of it."""
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


def _view(data: np.ndarray, entry: Entry, dtype: Dtype) -> np.ndarray:
    return data[entry.begin : entry.end].view(dtype.numpy).reshape(entry.shape)
