"""Shared prefixes on disk: the KV of a prompt prefix many agents start with, stored once.

Every Claude Code session (and every agent of one multi-agent script) starts
with the same long system prompt and tool list. The first agent to compute it
writes it here; any later agent whose prompt starts with it reads it back
instead of prefilling it, also after the first agent was evicted or deleted,
and after a restart.

A prefix file is an ordinary agent cache file (``cache_file.py``) of the
prefix's tokens, named by a content key: a chained BLAKE2b digest over whole
blocks of token ids (stable across processes, unlike Python's ``hash``), so a
prompt finds the longest stored prefix by walking its own block keys. Keys
only nominate: the file's token ids are compared with the prompt before use.

File I/O runs on the warm tier's I/O thread; the index is touched only on
the engine thread.
"""

from __future__ import annotations

import hashlib
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Sequence

import numpy as np

from engine.errors import CacheCorruptionError
from engine.domain.event_log import EventKind, EventLog
from engine.store.layer_slice import LayerSlice

from engine.store.cache_file import CacheRecord, WrittenFile, quarantine, read_cache_file, scan_directory, write_cache_file
from engine.store.file_names import AGENT_PREFIX
from engine.store.private_dirs import make_private_dir
from engine.store.stored_model import StoredModel
from engine.store.kv_at_rest import hot_quantization
from engine.store.to_mlx import to_mx_slices

log = logging.getLogger("semantic.store")

KEY_CHARS = 32


def block_keys(tokens: Sequence[int], block_tokens: int) -> list[str]:
    """One content key per whole block of ``tokens``: key i names tokens[: (i + 1) * block_tokens]."""
    data = np.asarray(tokens, dtype="<u4").tobytes()
    step = 4 * block_tokens
    keys: list[str] = []
    digest = b""
    for end in range(step, len(data) + 1, step):
        digest = hashlib.blake2b(digest + data[end - step:end], digest_size=16).digest()
        keys.append(digest.hex()[:KEY_CHARS])
    return keys


def prefix_key(tokens: Sequence[int], block_tokens: int) -> str:
    """The key of a whole-block prefix."""
    keys = block_keys(tokens, block_tokens)
    if not keys or len(tokens) % block_tokens:
        raise ValueError(f"a stored prefix is whole blocks of {block_tokens} tokens, got {len(tokens)}")
    return keys[-1]


@dataclass(slots=True)
class PrefixEntry:
    key: str
    n_tokens: int
    path: Path
    nbytes: int
    last_used: float = field(default_factory=time.time)
    # The file's header kv_quantization ({"bits", "group_size"}; None: full precision).
    kv_quantization: dict[str, int] | None = None


@dataclass(slots=True)
class _Read:
    future: "Future[CacheRecord]"
    started: float


class PrefixStore:
    def __init__(self, directory: Path, model: StoredModel, fingerprint: str, events: EventLog,
                 io: ThreadPoolExecutor) -> None:
        self.directory = directory
        self.model = model
        self.fingerprint = fingerprint
        self.block_tokens = model.spec.block_tokens
        self.events = events
        self._io = io
        self.entries: dict[str, PrefixEntry] = {}
        self._writes: dict[str, Future[WrittenFile]] = {}
        self._reads: dict[str, _Read] = {}
        self.usable = True

    # -- the index ------------------------------------------------------------------------
    def scan(self) -> None:
        try:
            make_private_dir(self.directory)
        except OSError as exc:
            self.usable = False
            self.events.emit(EventKind.ERROR, f"shared prefixes disabled: {self.directory} ({exc})", level=logging.ERROR)
            return
        result = scan_directory(self.directory)
        for path, reason in result.bad:
            quarantine(path, reason)
        for path, header in result.headers:
            key = header.agent_id.removeprefix(AGENT_PREFIX)
            if header.model_digest != self.model.identity.digest or header.spec_fingerprint != self.fingerprint:
                quarantine(path, "made by another model or cache layout")
                continue
            if prefix_key(header.token_ids, self.block_tokens) != key:
                quarantine(path, "its tokens do not match its key")
                continue
            self.entries[key] = PrefixEntry(key, header.n_tokens, path, path.stat().st_size, header.last_used,
                                            header.kv_quantization)

    def longest(
        self, prompt: Sequence[int], at_most: int, *, stored_as: dict[str, int] | None | Literal["any"] = "any",
    ) -> PrefixEntry | None:
        """The longest stored (or being written) prefix of ``prompt`` no longer than ``at_most`` tokens;
        with ``stored_as``, only one whose K/V are stored that way (a header's kv_quantization)."""
        keys = block_keys(prompt[:at_most], self.block_tokens)
        found = [self.entries[key] for key in keys if key in self.entries
                 and (stored_as == "any" or self.entries[key].kv_quantization == stored_as)]
        return found[-1] if found else None

    def has(self, tokens: Sequence[int]) -> bool:
        return prefix_key(tokens, self.block_tokens) in self.entries

    @property
    def disk_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    # -- writing ---------------------------------------------------------------------------
    def write(self, record: CacheRecord) -> None:
        """Store a prefix (its record's tokens are whole blocks); a no-op when it is stored already."""
        key = record.header.agent_id.removeprefix(AGENT_PREFIX)
        if not self.usable or key in self.entries or key in self._writes:
            return
        self._writes[key] = self._io.submit(write_cache_file, self.directory, record)
        path = self.directory / "pending"
        self.entries[key] = PrefixEntry(key, record.header.n_tokens, path, 0,
                                        kv_quantization=record.header.kv_quantization)

    def poll(self) -> None:
        """Settle finished writes (engine thread)."""
        for key, future in list(self._writes.items()):
            if not future.done():
                continue
            del self._writes[key]
            try:
                written = future.result()
            except Exception as exc:  # a prefix that could not be stored is only a lost optimization
                self.entries.pop(key, None)
                self.events.emit(EventKind.DISCARD, f"could not store shared prefix {key[:12]} ({exc})",
                                 level=logging.WARNING)
                continue
            entry = self.entries.get(key)
            if entry is not None:
                entry.path, entry.nbytes = written.path, written.nbytes
                self.events.emit(EventKind.EVICT, f"stored shared prefix {key[:12]}: {entry.n_tokens} tokens, "
                                 f"{written.nbytes / 2**20:.1f} MiB")

    # -- reading ---------------------------------------------------------------------------
    def read(self, key: str) -> CacheRecord | None:
        """The prefix's record once read; starts the read and answers None while it runs.

        A finished read is kept until taken, so a turn that cannot use it yet
        (no pool room) does not pay for the read again.
        """
        entry = self.entries.get(key)
        if entry is None:
            return None
        pending = self._writes.get(key)
        if pending is not None:
            return None  # still being written: readable once it is on disk
        read = self._reads.get(key)
        if read is None:
            self._reads[key] = _Read(self._io.submit(read_cache_file, entry.path, self.model.identity.digest,
                                                     self.fingerprint, expect_model_name=self.model.identity.name),
                                     time.monotonic())
            return None
        if not read.future.done():
            return None
        try:
            record = read.future.result()
        except (CacheCorruptionError, OSError) as exc:
            del self._reads[key]
            self.entries.pop(key, None)
            quarantine(entry.path, str(exc))
            self.events.emit(EventKind.DISCARD, f"shared prefix {key[:12]} unusable ({exc})", level=logging.WARNING)
            return None
        entry.last_used = time.time()
        return record

    def forget(self, key: str) -> None:
        """Delete a stored prefix (the disk budget needs the room)."""
        entry = self.entries.pop(key, None)
        self._reads.pop(key, None)
        if entry is not None and key not in self._writes:
            self._io.submit(_unlink_quietly, entry.path)
            self.events.emit(EventKind.EVICT, f"shared prefix {key[:12]} deleted (disk budget)")

    def slices_for(self, key: str, prompt: Sequence[int]) -> "list[LayerSlice] | None":
        """The stored prefix as MLX slices, when it is read and its tokens start ``prompt`` (engine thread)."""
        record = self.read(key)
        if record is None:
            return None
        if list(record.header.token_ids) != list(prompt[:record.header.n_tokens]):
            self.done_with(key)  # a key collision: the tokens decide, and they differ
            return None
        return to_mx_slices(record, hot_quantization(self.model.spec))

    def done_with(self, key: str) -> None:
        """The read record was used (or is no longer wanted): let it go."""
        self._reads.pop(key, None)

    def reading(self, key: str) -> bool:
        return key in self._reads or key in self._writes


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not delete %s: %s", path, exc)
