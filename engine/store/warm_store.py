"""The warm tier: agent caches on disk, one safetensors file per agent per model.

File I/O runs on one I/O thread; everything else (the index, budgets,
events) happens on the engine thread, which calls ``poll()`` every loop turn
to pick up finished jobs. The engine waits only where it needs the data: a
restore starts a read and the turn waits while other agents keep decoding.

A spilled agent's arrays stay referenced by its pending write until the file
is on disk, so an agent that comes back before then is restored from memory.
A restored agent's file is kept as a checkpoint: it is still a valid prefix
after a crash, and it is rewritten only when the cache changed.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from engine.domain.event_log import EventKind, EventLog
from engine.errors import CacheCorruptionError, InvalidRequestError
from engine.store.layer_slice import LayerSlice

from engine.store.cache_file import (
    CacheHeader,
    CacheRecord,
    KVQuantization,
    PersistedBlock,
    WrittenFile,
    cache_file_path,
    new_header,
    quarantine,
    read_cache_file,
    read_header,
    scan_directory,
    spec_fingerprint,
    write_cache_file,
)
from engine.store.cold_index import ColdIndex, ColdEntry
from engine.store.file_names import model_dir_name
from engine.store.kv_at_rest import (CacheAtRest, as_block, as_slice, block_nbytes, dequantized_slices, hot_quantization,
                                    quantization_for, quantize_blocks)
from engine.store.prefix_store import AGENT_PREFIX, PrefixEntry, PrefixStore, prefix_key
from engine.store.private_dirs import make_private_dir
from engine.store.stored_model import StoredModel
from engine.store.to_mlx import to_mx_slices

log = logging.getLogger("semantic.store")


class LoadState(enum.Enum):
    READY = "ready"
    PENDING = "pending"
    MISSING = "missing"


@dataclass(frozen=True, slots=True)
class AgentFile:
    """What an agent's file says of it besides its cache."""

    agent_id: str
    display_name: str | None
    source: str
    created_at: float
    last_used: float


@dataclass(slots=True)
class WarmEntry:
    agent_id: str
    path: Path
    n_tokens: int
    token_hash: str
    nbytes: int
    last_used: float
    display_name: str | None = None
    source: str | None = None
    # The shared prefix file this agent's file leaves its first tokens to (it must outlive the file).
    prefix_key: str | None = None


@dataclass(slots=True)
class PendingWrite:
    record: CacheRecord
    future: "Future[WrittenFile]"
    token_hash: str


@dataclass(slots=True)
class Loaded:
    """A cache ready to be installed into the pool."""

    tokens: list[int]
    slices: list[LayerSlice]
    from_memory: bool
    checkpoints: list[dict[str, Any]] = field(default_factory=list)


@dataclass(slots=True)
class StoreStats:
    writes: int = 0
    bytes_written: int = 0
    write_seconds: float = 0.0
    reads: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    discards: int = 0
    write_failures: int = 0
    went_cold: list[str] = field(default_factory=list)


def model_directory(root: Path, model: StoredModel) -> Path:
    """Where this model's warm files live; a sharded model's rank keeps its shards in a folder of its own."""
    directory = root / model_dir_name(model.identity.name, model.identity.digest)
    if model.shard is not None:
        rank, size = model.shard
        directory = directory / f"rank{rank}-of-{size}"
    return directory


class InlineExecutor:
    """Runs each job at once on the caller's thread: a sharded model's ranks must see every read
    and write finish at the same point of the engine loop (engine/distributed/lockstep.py)."""

    def submit(self, fn: Any, *args: Any, **kwargs: Any) -> "Future[Any]":
        future: Future[Any] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            future.set_exception(exc)
        return future

    def shutdown(self, wait: bool = True) -> None:
        pass


class IOThread:
    """The store's one I/O thread, and the caller's thread once that one is gone.

    At interpreter exit Python stops every ThreadPoolExecutor (concurrent.futures' exit hook runs before
    ``atexit``'s) while an engine still running then persists its agents from its own ``atexit`` stop: a
    submit would raise and the agents' hot caches would be lost with the process. They are written inline
    instead, each as atomically as on the thread."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="semantic-io")
        self._inline = InlineExecutor()

    def submit(self, fn: Any, *args: Any, **kwargs: Any) -> "Future[Any]":
        try:
            return self._pool.submit(fn, *args, **kwargs)
        except RuntimeError:  # the interpreter is exiting, or close() ran: the queue is drained either way
            return self._inline.submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait)


def token_hash(tokens: list[int]) -> str:
    return hashlib.blake2b(repr(tokens).encode(), digest_size=16).hexdigest()


class WarmStore:
    def __init__(self, root: Path, model: StoredModel, disk_budget_bytes: int, events: EventLog,
                 kv_bits_at_rest: int | None = None) -> None:
        self.directory = model_directory(root, model)
        self.model = model
        self.disk_budget_bytes = disk_budget_bytes
        # K/V written quantized (kv_at_rest.py); files of either kind load whatever the setting.
        self.quantization = quantization_for(kv_bits_at_rest, *model.spec.head_dims)
        # A pool that holds K/V quantized (--kv-bits): its caches rest packed as it holds them, and files packed
        # the same way come back as they are; other files convert (quantized once, or unpacked).
        self.hot = hot_quantization(model.spec)
        self.events = events
        self.fingerprint = spec_fingerprint(model.spec)
        self.entries: dict[str, WarmEntry] = {}
        self.cold = ColdIndex(self.directory / "cold.json")
        self.stats = StoreStats()
        self._writes: dict[str, PendingWrite] = {}
        self._reads: dict[str, tuple[Future[CacheRecord], float]] = {}
        # Finished reads not yet installed (the pool had no room): kept, never read twice.
        self._ready: dict[str, Loaded] = {}
        self._io: Any = InlineExecutor() if model.shard is not None else IOThread()
        self.usable = self._prepare_directory()
        # Shared prefixes live beside the agents, on the same I/O thread and disk budget.
        self.prefixes = PrefixStore(self.directory / "prefixes", model, self.fingerprint, events, self._io)

    # -- start-up -------------------------------------------------------------------------
    def _prepare_directory(self) -> bool:
        try:
            make_private_dir(self.directory.parent)
            make_private_dir(self.directory)
            probe = self.directory / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
            return True
        except OSError as exc:
            self.events.emit(
                EventKind.ERROR, f"warm tier disabled: cache directory {self.directory} is not writable ({exc})",
                level=logging.ERROR,
            )
            return False

    def scan(self) -> list[CacheHeader]:
        """Index the warm files of this model; quarantine the ones that are not usable."""
        if not self.usable:
            return []
        result = scan_directory(self.directory)
        for path, reason in result.bad:
            self._discard_file(path, reason, agent_id=None)
        headers = []
        for path, header in result.headers:
            if header.model_digest != self.model.identity.digest or header.spec_fingerprint != self.fingerprint:
                self._discard_file(path, "made by another model or cache layout", header.agent_id)
                continue
            self.entries[header.agent_id] = WarmEntry(
                header.agent_id, path, header.n_tokens, token_hash(header.token_ids), path.stat().st_size,
                header.last_used, header.display_name, header.source, (header.prefix or {}).get("key"),
            )
            headers.append(header)
        self.cold.load()
        self.prefixes.scan()
        # No budget pass here: the engine indexes every header returned as a warm agent first, and its first
        # poll() then turns the oldest cold as needed (evicting here dropped files the engine was about to
        # index, and the start failed: found crash-testing, after a kill between a write and the budget's pass).
        return headers

    # -- spill (hot -> warm) ------------------------------------------------------------------
    def holds(self, agent_id: str, tokens: list[int]) -> int | None:
        """The size of the agent's file when it already holds exactly ``tokens`` (nothing to write), else None."""
        entry = self.entries.get(agent_id)
        if entry is None or agent_id in self._writes or entry.token_hash != token_hash(tokens):
            return None
        return entry.nbytes

    def spill(self, agent: AgentFile, cache: CacheAtRest) -> int:
        """Start writing an agent's cache; returns its size in bytes. Engine thread.

        Full-precision blocks are quantized first when this store writes K/V
        quantized; a cache quantized already (a cool agent's) is written as it is.
        """
        if not self.usable or not cache.tokens:
            return 0
        record = self._record(agent, cache)
        self._cancel_read(agent.agent_id)
        future = self._io.submit(write_cache_file, self.directory, record)
        self._writes[agent.agent_id] = PendingWrite(record, future, token_hash(cache.tokens))
        return sum(block_nbytes(b) for b in record.blocks)

    def write_now(self, agent: AgentFile, cache: CacheAtRest) -> "Future[WrittenFile] | None":
        """Write an agent's cache to its file while it stays in memory (an export needs the file); the write's
        future, or None when the file already holds exactly this cache. Engine thread."""
        if self.holds(agent.agent_id, cache.tokens) is None:
            self.spill(agent, cache)
        pending = self._writes.get(agent.agent_id)
        return pending.future if pending is not None else None

    def finish_write(self, agent_id: str) -> None:
        """Wait for the agent's queued write (an import must not be overwritten by an older cache)."""
        pending = self._writes.get(agent_id)
        if pending is not None:
            try:
                pending.future.result()
            except Exception:
                pass  # poll() reports the failure
            self.poll()

    def adopt(self, path: Path) -> CacheHeader:
        """Index a file put into this model's folder while the server runs (an import). Engine thread.

        Raises CacheCorruptionError for a file of another model or cache layout (the importer
        checked it already; this is the store's own guard)."""
        header = read_header(path)
        if header.model_digest != self.model.identity.digest or header.spec_fingerprint != self.fingerprint:
            raise CacheCorruptionError(f"{path.name} was made by another model or cache layout")
        size = path.stat().st_size
        if size > self.disk_budget_bytes:
            self._io.submit(_unlink_quietly, path)
            raise InvalidRequestError(
                f"the agent file is {size / 2**20:.1f} MiB, more than the warm tier's whole disk budget "
                f"({self.disk_budget_bytes / 2**20:.1f} MiB); raise --disk-budget-mb to import it", field="body")
        self._cancel_read(header.agent_id)
        self.forget_cold(header.agent_id)
        # Imported just now: the most recently used file, whatever the header says it was last used (else the
        # budget would drop the import at once, as the oldest file, found crash-testing).
        self.entries[header.agent_id] = WarmEntry(
            header.agent_id, path, header.n_tokens, token_hash(header.token_ids), size,
            time.time(), header.display_name, header.source, (header.prefix or {}).get("key"),
        )
        self._enforce_budget(keep=header.agent_id)
        return header

    def _record(self, agent: AgentFile, cache: CacheAtRest) -> CacheRecord:
        quantization, blocks = cache.quantization, cache.blocks
        if quantization is None and self.quantization is not None:
            quantization, blocks = self.quantization, self._at_rest(blocks)
        header = new_header(
            agent.agent_id, self.model.identity, self.model.spec, cache.tokens, list(self.model.cache_classes), list(self.model.cache_meta),
            created_at=agent.created_at, last_used=agent.last_used, display_name=agent.display_name,
            source=agent.source, checkpoints=cache.checkpoints, prefix=cache.prefix, quantization=quantization,
        )
        return CacheRecord(header, blocks)

    def _at_rest(self, blocks: tuple[PersistedBlock, ...]) -> tuple[PersistedBlock, ...]:
        return blocks if self.quantization is None else quantize_blocks(blocks, self.quantization)

    # -- restore (warm -> hot) ------------------------------------------------------------------
    def load(self, agent_id: str) -> tuple[LoadState, Loaded | None]:
        """Poll for an agent's cache: from a pending write, a finished read, or start a read."""
        ready = self._ready.get(agent_id)
        if ready is not None:
            return LoadState.READY, ready
        pending = self._writes.get(agent_id)
        if pending is not None:
            if pending.record.header.prefix is not None:
                # The record leaves its first tokens to a prefix file: read both once the write is done.
                return LoadState.PENDING, None
            return LoadState.READY, _from_record(pending.record, from_memory=True, pool=self.hot)
        if agent_id in self._reads:
            return self._finish_read(agent_id)
        entry = self.entries.get(agent_id)
        if entry is None:
            return LoadState.MISSING, None
        self.prefetch(agent_id)
        return LoadState.PENDING, None

    def prefetch(self, agent_id: str) -> None:
        """Start reading an agent's file before its turn needs it."""
        entry = self.entries.get(agent_id)
        if entry is None or agent_id in self._reads or agent_id in self._writes:
            return
        prefix = self.prefixes.entries.get(entry.prefix_key) if entry.prefix_key else None
        if entry.prefix_key and prefix is None:
            future: Future[CacheRecord] = Future()
            future.set_exception(CacheCorruptionError(f"its shared prefix {entry.prefix_key[:12]} is gone"))
        else:
            future = self._io.submit(self._read_agent, entry.path, prefix.path if prefix else None)
        self._reads[agent_id] = (future, time.monotonic())

    def _read_agent(self, path: Path, prefix_path: Path | None) -> CacheRecord:
        """An agent's record, with the blocks it leaves to a shared prefix file joined back in (I/O thread)."""
        record = self._read(path)
        if prefix_path is None:
            return record
        prefix = self._read(prefix_path)
        expected = record.header.prefix or {}
        if prefix.header.token_ids != record.header.token_ids[: expected.get("n_tokens", -1)]:
            raise CacheCorruptionError(f"shared prefix {prefix_path.name} does not hold this agent's first tokens")
        globals_ = {g.index for g in self.model.spec.global_groups}
        shared = tuple(b for b in prefix.blocks if b.group in globals_ and b.checkpoint is None)
        return CacheRecord(record.header, shared + record.blocks)

    def _read(self, path: Path) -> CacheRecord:
        return read_cache_file(path, self.model.identity.digest, self.fingerprint,
                               expect_model_name=self.model.identity.name)

    def _finish_read(self, agent_id: str) -> tuple[LoadState, Loaded | None]:
        future, started = self._reads[agent_id]
        if not future.done():
            return LoadState.PENDING, None
        del self._reads[agent_id]
        try:
            record = future.result()
        except CacheCorruptionError as exc:
            entry = self.entries.pop(agent_id, None)
            if entry is not None:
                self._discard_file(entry.path, str(exc), agent_id)
            return LoadState.MISSING, None
        self.stats.reads += 1
        self.stats.read_seconds += time.monotonic() - started
        self.stats.bytes_read += self.entries[agent_id].nbytes if agent_id in self.entries else 0
        loaded = self._ready[agent_id] = _from_record(record, from_memory=False, pool=self.hot)
        return LoadState.READY, loaded

    def installed(self, agent_id: str) -> None:
        """The agent's read cache is in the pool now: let the loaded copy go."""
        self._ready.pop(agent_id, None)

    def _cancel_read(self, agent_id: str) -> None:
        self._ready.pop(agent_id, None)  # superseded: the agent's cache changed, or it is going
        read = self._reads.pop(agent_id, None)
        if read is not None:
            read[0].cancel()

    # -- forgetting and the budget ------------------------------------------------------------
    def forget(self, agent_id: str) -> None:
        """Delete an agent's file (explicit delete or drop to cold)."""
        self._cancel_read(agent_id)
        pending = self._writes.pop(agent_id, None)
        if pending is not None:
            pending.future.cancel()
        entry = self.entries.pop(agent_id, None)
        path = entry.path if entry is not None else cache_file_path(self.directory, agent_id)
        # Ordered after any write of this agent already running on the I/O thread.
        self._io.submit(_unlink_quietly, path)

    def remember_cold(self, entry: ColdEntry) -> None:
        self.cold.add(entry)
        self._io.submit(self.cold.save)

    def forget_cold(self, agent_id: str) -> None:
        if self.cold.remove(agent_id):
            self._io.submit(self.cold.save)

    @property
    def disk_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values()) + self.prefixes.disk_bytes

    # -- shared prefixes ------------------------------------------------------------------------
    def shared_prefix_for(self, tokens: list[int]) -> dict[str, Any] | None:
        """The longest prefix file on disk (not one still being written) that ``tokens`` start with, as a
        cache's ``prefix`` reference (``{"key", "n_tokens"}``): an agent's file then leaves those tokens to it.

        Only one stored as this store stores K/V (quantized or not, alike): a file holds one kind,
        and an export joins the prefix's blocks into the agent's file."""
        entry = self._stored_prefix_of(tokens)
        return None if entry is None else {"key": entry.key, "n_tokens": entry.n_tokens}

    def _stored_prefix_of(self, tokens: list[int]) -> "PrefixEntry | None":
        stored_as = self.hot or self.quantization
        entry = self.prefixes.longest(tokens, len(tokens), stored_as=stored_as.describe() if stored_as else None)
        return entry if entry is not None and not self.prefixes.reading(entry.key) else None

    def referenced_prefixes(self) -> set[str]:
        """Prefix files some agent file leaves its first tokens to: they stay while those files do."""
        return {e.prefix_key for e in self.entries.values() if e.prefix_key}

    def store_prefix(self, tokens: list[int], slices: list[LayerSlice]) -> None:
        """Write a shared prefix (whole blocks of ``tokens``, its K/V in ``slices``) unless it is stored."""
        if not self.usable or self.prefixes.has(tokens):
            return
        key = prefix_key(tokens, self.model.spec.block_tokens)
        header = new_header(
            AGENT_PREFIX + key, self.model.identity, self.model.spec, tokens, list(self.model.cache_classes), list(self.model.cache_meta),
            display_name=f"shared prefix of {len(tokens)} tokens", source="prefix", quantization=self.hot or self.quantization,
        )
        blocks = tuple(as_block(s) for s in slices)
        self.prefixes.write(CacheRecord(header, blocks if self.hot else self._at_rest(blocks)))

    def _enforce_budget(self, keep: str | None = None) -> None:
        """Oldest files go until the warm tier fits its budget: agents become cold, prefixes are forgotten.
        ``keep``: an agent whose file stays whatever its age (one being imported)."""
        files = [(e.last_used, e.agent_id) for e in self.entries.values() if e.agent_id != keep]
        files += [(e.last_used, AGENT_PREFIX + e.key) for e in self.prefixes.entries.values()]
        for _, name in sorted(files):
            if self.disk_bytes <= self.disk_budget_bytes:
                return
            if name.startswith(AGENT_PREFIX) and name not in self.entries:
                key = name.removeprefix(AGENT_PREFIX)
                if key not in self.referenced_prefixes():
                    self.prefixes.forget(key)
                continue
            entry = self.entries[name]
            if entry.agent_id in self._writes:
                continue
            self.entries.pop(entry.agent_id)
            self._io.submit(_unlink_quietly, entry.path)
            self.stats.went_cold.append(entry.agent_id)
            self.events.emit(EventKind.EVICT, f"{entry.agent_id}: warm -> cold (disk budget)", entry.agent_id)

    # -- the engine loop's hook ------------------------------------------------------------------
    def poll(self) -> None:
        """Apply finished writes and the disk budget (engine thread, every loop turn)."""
        for agent_id, pending in list(self._writes.items()):
            if pending.future.done():
                del self._writes[agent_id]
                self._settle_write(agent_id, pending)
        self.prefixes.poll()
        self._enforce_budget()

    def take_went_cold(self) -> list[str]:
        """Agents whose warm copy is gone since the last call (budget, write failure)."""
        went_cold, self.stats.went_cold = self.stats.went_cold, []
        return went_cold

    def _settle_write(self, agent_id: str, pending: PendingWrite) -> None:
        if pending.future.cancelled():
            return
        try:
            written = pending.future.result()
        except Exception as exc:
            # Not only CachePersistenceError (disk full, directory gone): poll runs
            # outside the engine step's error handling, so any failed write must
            # end here, as its agent going cold, never as a dead engine thread.
            self.stats.write_failures += 1
            self.stats.went_cold.append(agent_id)
            self.entries.pop(agent_id, None)
            self.events.emit(EventKind.DISCARD, f"{agent_id}: could not write warm cache ({exc})", agent_id, logging.WARNING)
            return
        header = pending.record.header
        self.entries[agent_id] = WarmEntry(
            agent_id, written.path, header.n_tokens, pending.token_hash, written.nbytes, header.last_used,
            header.display_name, header.source, (header.prefix or {}).get("key"),
        )
        self.stats.writes += 1
        self.stats.bytes_written += written.nbytes
        self.stats.write_seconds += written.seconds
        mb_s = written.nbytes / 2**20 / max(written.seconds, 1e-6)
        log.debug("wrote %s: %d bytes in %.3f s (%.0f MB/s)", agent_id, written.nbytes, written.seconds, mb_s)

    def flush(self) -> None:
        """Wait for every queued write and delete (shutdown, tests)."""
        self._io.submit(lambda: None).result()
        self.poll()

    def close(self) -> None:
        self.flush()
        self._io.shutdown(wait=True)

    def _discard_file(self, path: Path, reason: str, agent_id: str | None) -> None:
        self.stats.discards += 1
        where = quarantine(path, reason)
        target = f"moved to {where}" if where else "deleted"
        self.events.emit(EventKind.DISCARD, f"discarded {path.name}: {reason} ({target})", agent_id, logging.WARNING)


def _from_record(record: CacheRecord, from_memory: bool, pool: KVQuantization | None) -> Loaded:
    """The record's cache as slices to install: packed K/V as they are where the pool (``pool``: the hot
    pool's quantization) holds them packed the same way, else at full precision."""
    quantization = record.header.quantization
    if from_memory and quantization is not None and quantization != pool:
        slices = dequantized_slices(record.blocks, quantization)
    elif from_memory:
        slices = [as_slice(b) for b in record.blocks]
    else:
        slices = to_mx_slices(record, pool)
    return Loaded(list(record.header.token_ids), slices, from_memory, list(record.header.checkpoints))


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not delete %s: %s", path, exc)
