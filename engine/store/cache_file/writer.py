"""Writing one agent's cache file: planned in memory, streamed to a temp file, renamed.

The whole file is planned (and checked with the reader's own rules) before
anything touches the disk, so a record that would not read back raises
ValueError and leaves the old file alone. Each tensor then streams from its
memoryview straight into the file while the crc32 accumulates; the checksum
digits are patched in at the end, so the data is passed over once.
"""

from __future__ import annotations

import os
import secrets
import time
import zlib
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from engine.errors import CacheCorruptionError, CachePersistenceError

from engine.store.cache_file.format import (
    CHECKSUM_PLACEHOLDER,
    KV_DTYPES,
    PACKED_DTYPE,
    TOKEN_DTYPE,
    FORMAT_VERSION,
    QUANTIZED_FORMAT_VERSION,
    SUFFIX,
    TOKENS,
    CacheRecord,
    PersistedBlock,
    QuantizedArray,
    WrittenFile,
    Dtype,
    Entry,
)
from engine.store.cache_file.header import encode_head
from engine.store.durable import sync_directory, sync_file
from engine.store.cache_file.validation import check_blocks, spec_geometry, Geometry, token_entry
from engine.store.file_names import agent_file_stem
from engine.store.private_dirs import make_private_dir


@dataclass(frozen=True, slots=True)
class _Source:
    name: str
    dtype: Dtype
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
    final = directory / f"{agent_file_stem(record.header.agent_id)}{SUFFIX}"
    return write_cache_file_to(final, record, sync=sync, private_dir=True)


def write_cache_file_to(
    final: Path, record: CacheRecord, *, sync: bool = True, private_dir: bool = False
) -> WrittenFile:
    """:func:`write_cache_file` under any name: an agent export goes where the user says.

    ``private_dir`` creates the folder user-only (semantic's own folders); an
    export's folder is the user's, so it is used as it is, never re-moded.
    """
    started = time.perf_counter()
    plan = _plan(record)
    directory = final.parent
    temp = directory / f".{agent_file_stem(record.header.agent_id)}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        if private_dir:
            make_private_dir(directory)
        _write_temp(temp, plan, sync)
        os.replace(temp, final)
    except BaseException as err:
        remove_quietly(temp)
        if isinstance(err, OSError):
            raise CachePersistenceError(f"cannot write cache file {final}: {err}") from err
        raise
    if sync:
        sync_directory(directory)
    return WrittenFile(final, plan.nbytes, time.perf_counter() - started)


# -- the bytes on disk -------------------------------------------------------------------------
def _open_exclusive(path: Path) -> BinaryIO:
    # Exclusive, so two writers can never share a temp file; tests swap in a full disk here.
    # Owner-only: a cache encodes its prompts, and an export may land in a shared folder.
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb")


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
            sync_file(out.fileno())


def remove_quietly(path: Path) -> None:
    with suppress(OSError):
        path.unlink()


# -- the plan ----------------------------------------------------------------------------------
def _plan(record: CacheRecord) -> _Plan:
    """The file's head and tensor order, checked as the reader will check them."""
    header = record.header
    try:
        geometry = spec_geometry(header.spec)
        sources = [_token_source(header.token_ids), *_block_sources(record.blocks, geometry)]
        entries = _lay_out(sources)
        version = FORMAT_VERSION if header.kv_quantization is None else QUANTIZED_FORMAT_VERSION
        header = replace(header, format_version=version, checksum=CHECKSUM_PLACEHOLDER,
                         tensor_bytes=sum(e.end - e.begin for e in entries[1:]))
        head, checksum_at = encode_head(header, entries)  # checks the fields check_blocks reads
        token_entry(_by_name(entries), header.n_tokens)
        check_blocks(geometry, _by_name(entries), header)
    except CacheCorruptionError as err:
        raise ValueError(f"refusing to write a cache that would not read back: {err}") from None
    return _Plan(head, checksum_at, tuple(sources), len(head) + entries[-1].end)


def _token_source(token_ids: Sequence[int]) -> _Source:
    tokens = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**32):
        raise ValueError("token ids must fit uint32")
    return _source(TOKENS, tokens.astype("<u4"), TOKEN_DTYPE)


def _block_sources(blocks: Sequence[PersistedBlock], geometry: Geometry) -> list[_Source]:
    sources, dtype = [], geometry.dtype
    for block in sorted(blocks, key=lambda b: b.file_order):
        checkpoint = "" if block.checkpoint is None else f"c{block.checkpoint}."
        if block.states:
            sources += _state_sources(f"{checkpoint}g{block.group}.s{block.start}", block.states, geometry, block.group)
            continue
        for slot, (k, v) in enumerate(zip(block.keys, block.values)):
            prefix = f"{checkpoint}g{block.group}.b{block.start}.l{slot}"
            written = [*_kv_sources(f"{prefix}.k", k, dtype), *_kv_sources(f"{prefix}.v", v, dtype)]
            if {source.shape[2:3] for source in written} != {(block.length,)}:
                raise ValueError(f"{prefix}: arrays do not hold the block's {block.length} tokens")
            sources += written
    return sources


def _state_sources(prefix: str, states: Sequence[Sequence[Any]], geometry: Geometry, group: int) -> list[_Source]:
    """A recurrent group's state: each layer slot's arrays, each in its own dtype (the spec's)."""
    facts = geometry.groups.get(group)
    if facts is None or facts.state is None:
        raise ValueError(f"{prefix}: group {group} keeps no recurrent state")
    if any(len(arrays) != len(facts.state) for arrays in states):
        raise ValueError(f"{prefix}: a state of {len(facts.state)} arrays per layer expected")
    return [_source(f"{prefix}.l{slot}.a{j}", array, KV_DTYPES[facts.state[j][1]])
            for slot, arrays in enumerate(states) for j, array in enumerate(arrays)]


def _kv_sources(name: str, array: Any, dtype: Dtype) -> list[_Source]:
    """One K or V: its array, or a quantized one's packed words, scales and biases."""
    if not isinstance(array, QuantizedArray):
        return [_source(name, array, dtype)]
    return [_source(name, array.packed, PACKED_DTYPE), _source(f"{name}.scales", array.scales, dtype),
            _source(f"{name}.biases", array.biases, dtype)]


def _source(name: str, array: Any, dtype: Dtype) -> _Source:
    view = memoryview(array)
    if view.format not in dtype.formats or view.itemsize != dtype.itemsize:
        raise ValueError(f"tensor {name}: buffer format {view.format!r} is not {dtype.name}")
    if not view.c_contiguous:
        raise ValueError(f"tensor {name} is not C-contiguous")
    return _Source(name, dtype, tuple(view.shape), view.cast("B"))


def _lay_out(sources: Sequence[_Source]) -> list[Entry]:
    entries, position = [], 0
    for source in sources:
        end = position + source.data.nbytes
        entries.append(Entry(source.name, source.dtype.code, source.shape, position, end))
        position = end
    if len({e.name for e in entries}) != len(entries):
        raise ValueError("two blocks of one group (or checkpoint) start at the same position")
    return entries


def _by_name(entries: Sequence[Entry]) -> dict[str, Entry]:
    return {e.name: e for e in entries}
