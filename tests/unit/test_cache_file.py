"""The warm-tier cache file: exact round trips, atomic writes, and every corruption caught."""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import os
import re
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from safetensors import safe_open

from engine.domain.block_layout import block_spans
from engine.domain.cache_spec import ModelCacheSpec, group_layers
from engine.errors import CacheCorruptionError, CachePersistenceError
from engine.models.loaded import ModelIdentity
from engine.store import cache_file
from engine.store.cache_file import writer as cache_writer
from engine.store.cache_file import (
    CacheRecord,
    PersistedBlock,
    new_header,
    quarantine,
    read_cache_file,
    read_header,
    scan_directory,
    spec_fingerprint,
    write_cache_file,
)
from engine.store.to_mlx import to_mx_slices

MODEL = ModelIdentity("tiny", "ab" * 32)
OTHER_MODEL = ModelIdentity("other", "cd" * 32)
AGENT = "planner/../é 🦀"
B = 4  # block tokens
N_TOKENS = 10
SLIDING_START = 5  # mid-block: the window (4) needs tokens 6..9, the cache kept 5..9
# Layers 0 and 3 attend globally, the others through a 4-token window: one
# global group and two sliding groups of two layers each.
HYBRID_WINDOWS = [None, 4, 4, None, 4, 4]
MX_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def make_spec(dtype: str = "float32") -> ModelCacheSpec:
    return ModelCacheSpec(
        n_layers=6, n_kv_heads=2, head_dim=8, dtype=dtype, block_tokens=B,
        groups=group_layers(HYBRID_WINDOWS), v_head_dim=6, layer_windows=tuple(HYBRID_WINDOWS),
    )


def random_kv(length: int, width: int, dtype: str) -> tuple[mx.array, ...]:
    shape = (1, 2, length, width)
    arrays = tuple(mx.random.normal(shape).astype(MX_DTYPES[dtype]) for _ in range(2))
    mx.eval(arrays)
    return arrays


@dataclass(frozen=True)
class Cut:
    """A checkpoint to build: the sliding groups at ``offset``, their blocks from ``first`` on."""

    offset: int
    kind: str
    first: int


# With a 4-token window in 4-token blocks, a checkpoint at offset o may start
# anywhere in [o - 4, o - 3]: checkpoint 0 starts as early as it may, 1 as late.
CUTS = (Cut(6, "prefix", 2), Cut(9, "turn", 6))
PREFIX_KEY = "9f" * 32  # the shared prefix file's key: as long as a key may be


def make_record(
    dtype: str = "float32", n_tokens: int = N_TOKENS, agent_id: str = AGENT,
    cuts: Sequence[Cut] = (), shared: int = 0, **extra: Any,
) -> CacheRecord:
    """A hybrid cache; given ``shared``, a prefix file holds the global groups' first tokens."""
    spec = make_spec(dtype)
    blocks = []
    for group in spec.groups:
        first = shared if group.window is None else min(SLIDING_START, n_tokens)
        blocks += random_blocks(group.index, first, n_tokens, dtype)
    for i, cut in enumerate(cuts):
        for group in spec.sliding_groups:
            blocks += random_blocks(group.index, cut.first, cut.offset, dtype, checkpoint=i)
    classes = ["RotatingKVCache" if w else "KVCache" for w in HYBRID_WINDOWS]
    meta = [{"max_size": w, "keep": 0} if w else {} for w in HYBRID_WINDOWS]
    header = new_header(
        agent_id, MODEL, spec, [7 * i + 1 for i in range(n_tokens)], classes, meta,
        created_at=1700000000.25, last_used=1700000100.5, display_name="Planner",
        source="api", extra={"turns": 3, **extra},
        checkpoints=[{"offset": cut.offset, "kind": cut.kind} for cut in cuts],
        prefix={"key": PREFIX_KEY, "n_tokens": shared} if shared else None,
    )
    return CacheRecord(header, tuple(blocks))


def random_blocks(
    group: int, first: int, end: int, dtype: str, checkpoint: int | None = None
) -> list[PersistedBlock]:
    blocks = []
    for span in block_spans(first, end, B):
        keys, values = random_kv(span.length, 8, dtype), random_kv(span.length, 6, dtype)
        blocks.append(PersistedBlock(group, span.start, span.length, keys, values, checkpoint))
    return blocks


def read_back(path: Path, dtype: str = "float32") -> CacheRecord:
    return read_cache_file(path, MODEL.digest, spec_fingerprint(make_spec(dtype)))


def assert_same_blocks(written: CacheRecord, read: CacheRecord) -> None:
    restored = to_mx_slices(read)
    expected = sorted(written.blocks, key=lambda b: b.file_order)
    assert [(b.checkpoint, b.group, b.start, b.length) for b in expected] == [
        (s.checkpoint, s.group, s.start, s.length) for s in restored
    ]
    for block, data in zip(expected, restored):
        for want, have in zip(block.keys + block.values, data.keys + data.values):
            assert have.dtype == want.dtype and have.shape == want.shape
            assert mx.array_equal(have, want).item()


def assert_same_header(written: CacheRecord, read: CacheRecord) -> None:
    ignore = {"checksum", "tensor_bytes"}
    for name in cache_file.CacheHeader.__slots__:
        if name not in ignore:
            assert getattr(read.header, name) == getattr(written.header, name), name
    assert read.header.checksum.startswith("crc32:")


# -- round trips ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_round_trip_is_bit_exact(tmp_path: Path, dtype: str) -> None:
    record = make_record(dtype)
    written = write_cache_file(tmp_path, record)
    assert written.path == cache_file.cache_file_path(tmp_path, AGENT)
    assert written.nbytes == written.path.stat().st_size
    read = read_back(written.path, dtype)
    assert_same_header(record, read)
    assert_same_blocks(record, read)
    kv_bytes = sum(a.nbytes for b in record.blocks for a in b.keys + b.values)
    assert read.header.tensor_bytes == kv_bytes


@pytest.mark.parametrize("cuts", [(), CUTS], ids=["plain", "checkpoints"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_restored_and_read_records_rewrite_byte_identically(
    tmp_path: Path, dtype: str, cuts: tuple[Cut, ...]
) -> None:
    first = write_cache_file(tmp_path / "a", make_record(dtype, cuts=cuts)).path
    read = read_back(first, dtype)
    as_mlx = tuple(
        PersistedBlock(s.group, s.start, s.length, s.keys, s.values, s.checkpoint)
        for s in to_mx_slices(read)
    )
    again_from_mlx = write_cache_file(tmp_path / "b", CacheRecord(read.header, as_mlx)).path
    again_from_numpy = write_cache_file(tmp_path / "c", read).path
    assert again_from_mlx.read_bytes() == first.read_bytes() == again_from_numpy.read_bytes()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_checkpoints_round_trip(tmp_path: Path, dtype: str) -> None:
    record = make_record(dtype, cuts=CUTS)
    path = write_cache_file(tmp_path, record).path
    read = read_back(path, dtype)
    assert read.header.checkpoints == [
        {"offset": 6, "kind": "prefix"}, {"offset": 9, "kind": "turn"},
    ]
    assert_same_header(record, read)
    assert_same_blocks(record, read)
    checkpointed = [b for b in read.blocks if b.checkpoint is not None]
    assert [(b.checkpoint, b.group, b.start, b.length) for b in checkpointed] == [
        (0, 1, 2, 2), (0, 1, 4, 2), (0, 2, 2, 2), (0, 2, 4, 2),
        (1, 1, 6, 2), (1, 1, 8, 1), (1, 2, 6, 2), (1, 2, 8, 1),
    ]
    assert read_header(path) == read.header


def test_checkpoint_tensors_follow_the_cache_in_order(tmp_path: Path) -> None:
    path = write_cache_file(tmp_path, make_record(cuts=CUTS)).path
    table, _ = load_raw(path)
    names = sorted((v["data_offsets"][0], k) for k, v in table.items() if k != "__metadata__")
    blocks = [".".join(name.split(".")[:-2]) for _, name in names if name.endswith(".l0.k")]
    assert blocks == [
        "g0.b0", "g0.b4", "g0.b8", "g1.b5", "g1.b8", "g2.b5", "g2.b8",
        "c0.g1.b2", "c0.g1.b4", "c0.g2.b2", "c0.g2.b4",
        "c1.g1.b6", "c1.g1.b8", "c1.g2.b6", "c1.g2.b8",
    ]
    with safe_open(str(path), framework="numpy") as f:
        assert f.get_tensor("c1.g2.b8.l1.v").shape == (1, 2, 1, 6)


def own_global_blocks(record: CacheRecord) -> list[tuple[int, int]]:
    return [(b.start, b.length) for b in record.blocks if b.group == 0 and b.checkpoint is None]


@pytest.mark.parametrize(
    ("n_tokens", "shared", "cuts", "global_blocks"),
    [
        (10, 4, (), [(4, 4), (8, 2)]),
        (10, 8, (), [(8, 2)]),
        (12, 12, (), []),
        (10, 8, CUTS, [(8, 2)]),
    ],
    ids=["one block shared", "two blocks shared", "all shared", "with checkpoints"],
)
def test_prefix_reference_round_trips(
    tmp_path: Path, n_tokens: int, shared: int, cuts: tuple[Cut, ...],
    global_blocks: list[tuple[int, int]],
) -> None:
    record = make_record(n_tokens=n_tokens, cuts=cuts, shared=shared)
    path = write_cache_file(tmp_path / "a", record).path
    read = read_back(path)
    assert read.header.prefix == {"key": PREFIX_KEY, "n_tokens": shared}
    assert read.header.token_ids == [7 * i + 1 for i in range(n_tokens)]  # the prefix's too
    assert own_global_blocks(read) == global_blocks
    assert_same_header(record, read)
    assert_same_blocks(record, read)
    assert read_header(path) == read.header
    assert write_cache_file(tmp_path / "b", read).path.read_bytes() == path.read_bytes()


def test_prefix_field_follows_checkpoints(tmp_path: Path) -> None:
    path = write_cache_file(tmp_path, make_record(cuts=CUTS, shared=8)).path
    table, _ = load_raw(path)
    fields = list(json.loads(table["__metadata__"]["semantic"]))
    assert fields[fields.index("checkpoints"):][:3] == ["checkpoints", "prefix", "created_at"]
    assert fields[-1] == "checksum"


def pinned_record() -> CacheRecord:
    """make_record() with K/V counting up instead of random, so its file's bytes can be pinned."""
    record = make_record()
    counter = itertools.count()

    def counting(arrays: tuple[Any, ...]) -> tuple[np.ndarray, ...]:
        return tuple(
            np.arange(a.size, dtype=np.float32).reshape(a.shape) + 1000 * next(counter)
            for a in arrays
        )

    blocks = tuple(
        replace(b, keys=counting(b.keys), values=counting(b.values)) for b in record.blocks
    )
    return CacheRecord(record.header, blocks)


# sha256 of pinned_record()'s file as written before checkpoints were added to the format.
PINNED_SIZE = 7728
PINNED_SHA256 = "e79da118004a2d65d1c05840d949e9c827d1b96b2c25a7630d246b32164b5fff"


def test_a_file_without_checkpoints_is_byte_identical_to_before(tmp_path: Path) -> None:
    record = pinned_record()
    path = write_cache_file(tmp_path / "a", record).path
    data = path.read_bytes()
    assert (len(data), hashlib.sha256(data).hexdigest()) == (PINNED_SIZE, PINNED_SHA256)
    explicit = CacheRecord(replace(record.header, checkpoints=[]), record.blocks)
    assert write_cache_file(tmp_path / "b", explicit).path.read_bytes() == data
    table, _ = load_raw(path)
    assert "checkpoints" not in json.loads(table["__metadata__"]["semantic"])
    assert read_back(path).header.checkpoints == []


def test_a_file_without_a_prefix_reference_is_byte_identical_to_before(tmp_path: Path) -> None:
    record = pinned_record()
    explicit = CacheRecord(replace(record.header, prefix=None), record.blocks)
    path = write_cache_file(tmp_path, explicit).path
    data = path.read_bytes()
    assert (len(data), hashlib.sha256(data).hexdigest()) == (PINNED_SIZE, PINNED_SHA256)
    table, _ = load_raw(path)
    assert "prefix" not in json.loads(table["__metadata__"]["semantic"])
    assert read_back(path).header.prefix is None


def test_read_header_matches_the_full_read(tmp_path: Path) -> None:
    path = write_cache_file(tmp_path, make_record()).path
    assert read_header(path) == read_back(path).header


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_mlx_loads_the_file(tmp_path: Path, dtype: str) -> None:
    record = make_record(dtype)
    path = write_cache_file(tmp_path, record).path
    tensors, metadata = mx.load(str(path), return_metadata=True)
    assert metadata["format"] == "semantic-agent-cache"
    assert json.loads(metadata["semantic"])["agent_id"] == AGENT
    assert tensors["token_ids"].tolist() == record.header.token_ids
    for block in record.blocks:
        for slot, (k, v) in enumerate(zip(block.keys, block.values)):
            prefix = f"g{block.group}.b{block.start}.l{slot}"
            for loaded, original in ((tensors[f"{prefix}.k"], k), (tensors[f"{prefix}.v"], v)):
                assert loaded.dtype == original.dtype
                assert mx.array_equal(loaded, original).item()


def test_safetensors_library_loads_the_file(tmp_path: Path) -> None:
    record = make_record("float32")
    path = write_cache_file(tmp_path, record).path
    with safe_open(str(path), framework="numpy") as f:
        assert f.metadata()["format"] == "semantic-agent-cache"
        assert f.get_tensor("token_ids").tolist() == record.header.token_ids
        block = record.blocks[-1]
        values = f.get_tensor(f"g{block.group}.b{block.start}.l1.v")
        np.testing.assert_array_equal(values, np.array(block.values[1]))


def test_empty_cache_round_trips(tmp_path: Path) -> None:
    record = make_record(n_tokens=0)
    read = read_back(write_cache_file(tmp_path, record).path)
    assert read.blocks == () and read.header.token_ids == [] and read.header.n_tokens == 0


def test_read_arrays_are_read_only_views(tmp_path: Path) -> None:
    read = read_back(write_cache_file(tmp_path, make_record("bfloat16")).path, "bfloat16")
    keys = read.blocks[0].keys[0]
    assert keys.dtype == np.uint16 and not keys.flags.writeable


def test_rewriting_an_agent_replaces_its_file(tmp_path: Path) -> None:
    write_cache_file(tmp_path, make_record(generation=1))
    write_cache_file(tmp_path, make_record(generation=2))
    assert len(os.listdir(tmp_path)) == 1
    assert read_back(cache_file.cache_file_path(tmp_path, AGENT)).header.extra["generation"] == 2


def test_cache_file_module_does_not_import_mlx() -> None:
    code = (
        "import sys, engine.store.cache_file; "
        "print(any(m.startswith('mlx') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- the writer refuses records it could not read back -------------------------------------------
def drop_last_block(record: CacheRecord) -> CacheRecord:
    return CacheRecord(record.header, record.blocks[:-1])


def strided_keys(record: CacheRecord) -> CacheRecord:
    block = record.blocks[0]
    wide = mx.random.normal((1, 2, block.length, 16))
    mx.eval(wide)
    keys = (wide[..., ::2], *block.keys[1:])
    first = PersistedBlock(block.group, block.start, block.length, keys, block.values)
    return CacheRecord(record.header, (first, *record.blocks[1:]))


@pytest.mark.parametrize(
    ("broken", "reason"),
    [
        (drop_last_block, "covers tokens up to"),
        (strided_keys, "not C-contiguous"),
        (lambda r: CacheRecord(replace(r.header, n_tokens=3), r.blocks), "token_ids"),
        (lambda r: CacheRecord(replace(r.header, token_ids=[-1] * N_TOKENS), r.blocks), "uint32"),
        (lambda r: CacheRecord(replace(r.header, display_name=3), r.blocks), "display_name"),
    ],
)
def test_writer_refuses_invalid_records(
    tmp_path: Path, broken: Callable[[CacheRecord], CacheRecord], reason: str
) -> None:
    with pytest.raises(ValueError, match=reason):
        write_cache_file(tmp_path, broken(make_record()))
    assert os.listdir(tmp_path) == []


def test_writer_refuses_arrays_of_another_dtype(tmp_path: Path) -> None:
    record = make_record("float16")
    header = replace(record.header, spec=make_spec("float32").describe())
    with pytest.raises(ValueError, match="is not float32"):
        write_cache_file(tmp_path, CacheRecord(header, record.blocks))


# -- atomicity and OS errors ---------------------------------------------------------------------
class DiskFullAfter:
    """A temp file that fills the disk after ``budget`` bytes, having written that much."""

    def __init__(self, path: Path, budget: int) -> None:
        self._file = open(path, "xb")
        self._left = budget

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes > self._left:
            self._file.write(view[: self._left])
            self._left = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._left -= view.nbytes
        return self._file.write(view)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)

    def __enter__(self) -> DiskFullAfter:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()


@pytest.fixture
def old_file(tmp_path: Path) -> tuple[CacheRecord, Path]:
    record = make_record(generation=1)
    return record, write_cache_file(tmp_path, record).path


def assert_only_old_file(directory: Path, old: tuple[CacheRecord, Path]) -> None:
    record, path = old
    assert os.listdir(directory) == [path.name]
    assert_same_blocks(record, read_back(path))


@pytest.mark.parametrize("budget", [0, 100, 3000])
def test_disk_full_mid_write_keeps_the_old_file(
    tmp_path: Path, old_file: tuple[CacheRecord, Path], monkeypatch: pytest.MonkeyPatch, budget: int
) -> None:
    monkeypatch.setattr(cache_writer, "_open_exclusive", lambda path: DiskFullAfter(path, budget))
    with pytest.raises(CachePersistenceError, match=f"{old_file[1].name}.*No space left"):
        write_cache_file(tmp_path, make_record(generation=2))
    assert_only_old_file(tmp_path, old_file)


def test_failed_rename_keeps_the_old_file(
    tmp_path: Path, old_file: tuple[CacheRecord, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing_replace(src: Any, dst: Any) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(cache_writer.os, "replace", failing_replace)
    with pytest.raises(CachePersistenceError, match="I/O error"):
        write_cache_file(tmp_path, make_record(generation=2))
    monkeypatch.undo()
    assert_only_old_file(tmp_path, old_file)


def test_interrupt_mid_write_removes_the_temp_file(
    tmp_path: Path, old_file: tuple[CacheRecord, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted_sync(fd: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cache_writer, "sync_file", interrupted_sync)
    with pytest.raises(KeyboardInterrupt):
        write_cache_file(tmp_path, make_record(generation=2))
    assert_only_old_file(tmp_path, old_file)


def test_directory_path_that_is_a_file(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "warm"
    not_a_dir.write_text("")
    with pytest.raises(CachePersistenceError, match="warm"):
        write_cache_file(not_a_dir, make_record())
    assert os.listdir(tmp_path) == ["warm"]


@contextmanager
def read_only_directory(directory: Path) -> Iterator[None]:
    """Make ``directory`` unwritable for this process.

    chmod is enough for ordinary users, but root ignores permission bits, and
    these tests often run as root in containers; there a read-only bind mount
    of the directory onto itself does the job (EROFS), where mounting is allowed.
    """
    if os.geteuid() != 0:
        directory.chmod(0o500)
        try:
            yield
        finally:
            directory.chmod(0o700)
        return
    where = str(directory)
    bind = subprocess.run(["mount", "--bind", where, where], capture_output=True, text=True)
    if bind.returncode != 0:
        pytest.skip(f"running as root, and bind mounts are not permitted: {bind.stderr.strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", where], check=True, capture_output=True)
        yield
    finally:
        subprocess.run(["umount", str(directory)], check=True)


def test_unwritable_directory_raises_persistence_error(tmp_path: Path) -> None:
    directory = tmp_path / "warm"
    directory.mkdir()
    with read_only_directory(directory):
        refused = "(Permission denied|Read-only file system)"
        with pytest.raises(CachePersistenceError, match=refused):
            write_cache_file(directory, make_record())
        assert os.listdir(directory) == []


# -- corruption: every defect is named -----------------------------------------------------------
def load_raw(path: Path) -> tuple[dict[str, Any], dict[str, bytes]]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    table = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    tensors = {k: v for k, v in table.items() if k != "__metadata__"}
    blobs = {k: data[v["data_offsets"][0] : v["data_offsets"][1]] for k, v in tensors.items()}
    return table, blobs


def save_raw(path: Path, table: dict[str, Any], data: bytes) -> None:
    # The writer puts __metadata__ last (its checksum digits sit at the end); keep it there.
    tensors = {k: v for k, v in table.items() if k != "__metadata__"}
    table = {**tensors, "__metadata__": table["__metadata__"]}
    text = json.dumps(table, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def rewrite(
    path: Path,
    table_edit: Callable[[dict[str, Any]], None] = lambda t: None,
    header_edit: Callable[[dict[str, Any]], None] = lambda h: None,
    drop: tuple[str, ...] = (),
) -> None:
    """Edit a file's header, or drop tensors and re-lay the data; the checksum goes stale."""
    table, blobs = load_raw(path)
    semantic = json.loads(table["__metadata__"]["semantic"])
    header_edit(semantic)
    table["__metadata__"]["semantic"] = json.dumps(semantic, separators=(",", ":"))
    table_edit(table)
    if not drop:
        (n,) = struct.unpack("<Q", path.read_bytes()[:8])
        save_raw(path, table, path.read_bytes()[8 + n :])
        return
    metadata = table.pop("__metadata__")
    names = [name for name in table if name not in drop]
    position, relaid = 0, {}
    for name in names:
        size = len(blobs[name])
        relaid[name] = {**table[name], "data_offsets": [position, position + size]}
        position += size
    save_raw(path, {**relaid, "__metadata__": metadata}, b"".join(blobs[name] for name in names))


def block_names(group: int, start: int) -> tuple[str, ...]:
    return tuple(f"g{group}.b{start}.l{slot}.{kind}" for slot in range(2) for kind in "kv")


def set_in(table_path: list[str], value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(table: dict[str, Any]) -> None:
        node = table
        for key in table_path[:-1]:
            node = node[key]
        node[table_path[-1]] = value
    return edit


def patch_bytes(offset: int, data: bytes) -> Callable[[Path], None]:
    def corrupt(path: Path) -> None:
        raw = bytearray(path.read_bytes())
        raw[offset : offset + len(data)] = data
        path.write_bytes(bytes(raw))
    return corrupt


def truncate_to(size: int) -> Callable[[Path], None]:
    return lambda path: path.write_bytes(path.read_bytes()[:size])


def header_size(path: Path) -> int:
    return 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]


def rename(old: str, new: str) -> Callable[[dict[str, Any]], None]:
    return lambda table: table.update({new: table.pop(old)})


def overlap(table: dict[str, Any]) -> None:
    table["g0.b0.l1.k"]["data_offsets"] = table["g0.b0.l0.k"]["data_offsets"]


def move_group_2_to_7(table: dict[str, Any]) -> None:
    for name in block_names(2, 8):
        table[name.replace("g2", "g7")] = table.pop(name)


def checksum_first(header: dict[str, Any]) -> None:
    rest = {k: v for k, v in header.items() if k != "checksum"}
    checksum = header["checksum"]
    header.clear()
    header.update({"checksum": checksum, **rest})


def on_header(**edits: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    return lambda path: rewrite(path, **edits)


CORRUPTIONS: dict[str, tuple[Callable[[Path], None], str]] = {
    "too short": (truncate_to(5), "too short for the header length"),
    "absurd header length": (patch_bytes(0, struct.pack("<Q", 2**60)),
                             "header length 1152921504606846976 is absurd"),
    "truncated header": (truncate_to(200), "truncated: the header claims"),
    "truncated data": (lambda p: truncate_to(p.stat().st_size - 10)(p),
                       "truncated: the tensors need"),
    "trailing bytes": (lambda p: p.write_bytes(p.read_bytes() + b"\0" * 4),
                       "4 trailing bytes after the last tensor"),
    "bad JSON": (patch_bytes(8, b"x"), "bad JSON header"),
    "missing format": (on_header(table_edit=lambda t: t["__metadata__"].pop("format")),
                       "no format in the metadata"),
    "unknown format": (on_header(table_edit=set_in(["__metadata__", "format"], "pt")),
                       "unknown format 'pt'"),
    "future version": (on_header(header_edit=set_in(["format_version"], 3)),
                       "unsupported format_version 3"),
    "version 2 without quantization": (on_header(header_edit=set_in(["format_version"], 2)),
                                       "format_version 2 without kv_quantization"),
    "bad field": (on_header(header_edit=set_in(["n_tokens"], "10")),
                  "header field n_tokens has a bad value '10'"),
    "edited spec": (on_header(header_edit=set_in(["spec", "n_kv_heads"], 4)),
                    "does not match its own fingerprint"),
    "overlap": (on_header(table_edit=overlap),
                "tensor 'g0.b0.l1.k' at bytes [40, 296) overlaps the tensor ending at 296"),
    "bad offsets": (on_header(table_edit=set_in(["g0.b0.l1.k", "data_offsets"], [5])),
                    "bad data_offsets"),
    "unknown dtype": (on_header(table_edit=set_in(["g0.b0.l0.k", "dtype"], "I8")),
                      "unexpected dtype 'I8'"),
    "wrong dtype": (on_header(table_edit=set_in(["g0.b0.l0.k", "dtype"], "U32")),
                    "unexpected dtype U32, the spec stores float32"),
    "wrong shape": (on_header(table_edit=set_in(["g0.b0.l0.k", "shape"], [1, 8, 4, 2])),
                    "shape [1, 8, 4, 2], the spec needs [1, 2, n, 8]"),
    "unknown tensor": (on_header(table_edit=rename("g0.b0.l0.k", "extra")),
                       "unexpected tensor 'extra'"),
    "no token ids": (on_header(table_edit=rename("token_ids", "tokens")), "no token_ids tensor"),
    "unknown group": (on_header(table_edit=move_group_2_to_7), "tensor group 7 is not in the spec"),
    "checksum not last": (on_header(header_edit=checksum_first),
                          "the checksum is not the header's last field"),
    "half a block": (on_header(drop=block_names(0, 4)[:2]), "block g0.b4 lacks k or v"),
    "gap in a run": (on_header(drop=block_names(0, 4)),
                     "group 0 is not contiguous: a block starts at 8 after one ending at 4"),
    "short run": (on_header(drop=block_names(0, 8)),
                  "group 0 covers tokens up to 8, the cache holds 10"),
    "window not covered": (on_header(drop=block_names(1, 5)),
                           "group 1 starts at token 8, but must hold token 6 on"),
    "layer count": (on_header(header_edit=set_in(["cache_classes"], ["KVCache"])),
                    "header describes [1, 6] layer caches"),
    "tensor bytes": (on_header(header_edit=set_in(["tensor_bytes"], 1)),
                     "header says 1 tensor bytes"),
    "flipped tensor byte": (lambda p: patch_bytes(p.stat().st_size - 1, b"\x55")(p),
                            "checksum mismatch"),
    "edited agent id": (on_header(header_edit=set_in(["agent_id"], "intruder")),
                        "checksum mismatch"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corruption_is_named(tmp_path: Path, case: str) -> None:
    corrupt, reason = CORRUPTIONS[case]
    path = write_cache_file(tmp_path, make_record()).path
    corrupt(path)
    with pytest.raises(CacheCorruptionError) as caught:
        read_back(path)
    assert str(caught.value).startswith(f"{path}: ")
    assert reason in str(caught.value)


def checkpoint_names(checkpoint: int, group: int, start: int) -> tuple[str, ...]:
    return tuple(f"c{checkpoint}.{name}" for name in block_names(group, start))


def rename_block(old: tuple[str, ...], new: tuple[str, ...]) -> Callable[[dict[str, Any]], None]:
    def edit(table: dict[str, Any]) -> None:
        for before, after in zip(old, new):
            table[after] = table.pop(before)
    return edit


# Applied to make_record(cuts=CUTS): checkpoint 0 holds tokens 2..5, checkpoint 1 tokens 6..8.
CHECKPOINT_CORRUPTIONS: dict[str, tuple[Callable[[Path], None], str]] = {
    "on a global group": (
        on_header(table_edit=rename_block(checkpoint_names(0, 1, 2), checkpoint_names(0, 0, 2))),
        "checkpoint 0 has blocks of global group 0; checkpoints hold only sliding-window groups"),
    "not ending at its offset": (on_header(header_edit=set_in(["checkpoints", 1, "offset"], 8)),
                                 "checkpoint 1 group 1 covers tokens up to 9, its offset is 8"),
    "starting too late": (on_header(drop=checkpoint_names(1, 1, 6)),
                          "checkpoint 1 group 1 starts at token 8, but must hold token 6 on"),
    "missing a sliding group": (
        on_header(drop=checkpoint_names(0, 2, 2) + checkpoint_names(0, 2, 4)),
        "checkpoint 0 has no blocks of sliding-window group 2"),
    "offset past the cache": (on_header(header_edit=set_in(["checkpoints", 1, "offset"], 11)),
                              "header field checkpoints has offset 11, outside 1..10 (n_tokens)"),
    "offset zero": (on_header(header_edit=set_in(["checkpoints", 0, "offset"], 0)),
                    "header field checkpoints has offset 0, outside 1..10 (n_tokens)"),
    "offsets not increasing": (
        on_header(header_edit=set_in(["checkpoints", 1, "offset"], 6)),
        "header field checkpoints has offsets [6, 6], not strictly increasing"),
    "orphan index": (
        on_header(header_edit=set_in(["checkpoints"], [{"offset": 6, "kind": "prefix"}])),
        "tensors of checkpoint 1, which the header does not list (it lists 1)"),
    "unknown kind": (on_header(header_edit=set_in(["checkpoints", 0, "kind"], "branch")),
                     "header field checkpoints has a bad value"),
    "offset not an int": (on_header(header_edit=set_in(["checkpoints", 0, "offset"], True)),
                          "header field checkpoints has a bad value"),
    "not a list": (on_header(header_edit=set_in(["checkpoints"], {"offset": 6})),
                   "header field checkpoints has a bad value"),
    "tensor shape": (on_header(table_edit=set_in(["c0.g1.b2.l0.k", "shape"], [1, 8, 2, 2])),
                     "tensor c0.g1.b2.l0.k has shape [1, 8, 2, 2], the spec needs [1, 2, n, 8]"),
    "half a block": (on_header(drop=checkpoint_names(0, 1, 4)[:2]), "block c0.g1.b4 lacks k or v"),
    "unknown name": (on_header(table_edit=rename("c0.g1.b2.l0.k", "x0.g1.b2.l0.k")),
                     "unexpected tensor 'x0.g1.b2.l0.k'"),
    "edited kind": (on_header(header_edit=set_in(["checkpoints", 0, "kind"], "turn")),
                    "checksum mismatch"),
    "flipped tensor byte": (lambda p: patch_bytes(p.stat().st_size - 1, b"\x55")(p),
                            "checksum mismatch"),
}


@pytest.mark.parametrize("case", list(CHECKPOINT_CORRUPTIONS))
def test_checkpoint_corruption_is_named(tmp_path: Path, case: str) -> None:
    corrupt, reason = CHECKPOINT_CORRUPTIONS[case]
    path = write_cache_file(tmp_path, make_record(cuts=CUTS)).path
    corrupt(path)
    with pytest.raises(CacheCorruptionError) as caught:
        read_back(path)
    assert str(caught.value).startswith(f"{path}: ")
    assert reason in str(caught.value)


def add_before_checksum(name: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(header: dict[str, Any]) -> None:
        checksum = header.pop("checksum")
        header.update({name: value, "checksum": checksum})  # checksum stays last
    return edit


def set_prefix(**values: Any) -> Callable[[Path], None]:
    return on_header(header_edit=lambda h: h.update(prefix={**h["prefix"], **values}))


# Applied to make_record(shared=8): the prefix file holds tokens 0..7, global group 0 only 8..9.
PREFIX_CORRUPTIONS: dict[str, tuple[Callable[[Path], None], str]] = {
    "key in capitals": (set_prefix(key="9F" * 32), "header field prefix has a bad value"),
    "key too long": (set_prefix(key="a" * 65), "header field prefix has a bad value"),
    "empty key": (set_prefix(key=""), "header field prefix has a bad value"),
    "key not a string": (set_prefix(key=9), "header field prefix has a bad value"),
    "no tokens": (set_prefix(n_tokens=0), "header field prefix has a bad value"),
    "tokens not an int": (set_prefix(n_tokens=8.0), "header field prefix has a bad value"),
    "tokens a bool": (set_prefix(n_tokens=True), "header field prefix has a bad value"),
    "unknown field": (set_prefix(agent="x"), "header field prefix has a bad value"),
    "null": (on_header(header_edit=set_in(["prefix"], None)),
             "header field prefix has a bad value None"),
    "not a block multiple": (set_prefix(n_tokens=6), "header field prefix has n_tokens 6, "
                                                     "not a multiple of the spec's 4-token blocks"),
    "past the cache": (set_prefix(n_tokens=12),
                       "header field prefix has n_tokens 12, more than the cache's 10 (n_tokens)"),
    "shorter than the gap": (set_prefix(n_tokens=4),
                             "global group 0 starts at token 8, but with a prefix reference of "
                             "4 tokens it must start at token 4"),
    "reference dropped": (on_header(header_edit=lambda h: h.pop("prefix")),
                          "global group 0 starts at token 8, but with no prefix reference "
                          "it must start at token 0"),
    "edited key": (set_prefix(key="ab"), "checksum mismatch"),
}


@pytest.mark.parametrize("case", list(PREFIX_CORRUPTIONS))
def test_prefix_corruption_is_named(tmp_path: Path, case: str) -> None:
    corrupt, reason = PREFIX_CORRUPTIONS[case]
    path = write_cache_file(tmp_path, make_record(shared=8)).path
    corrupt(path)
    with pytest.raises(CacheCorruptionError) as caught:
        read_back(path)
    assert str(caught.value).startswith(f"{path}: ")
    assert reason in str(caught.value)


@pytest.mark.parametrize(
    ("n_tokens", "shared", "prefix", "reason"),
    [
        (10, 0, {"key": PREFIX_KEY, "n_tokens": 8},
         "global group 0 starts at token 0, but with a prefix reference of 8 tokens "
         "it must start at token 8"),
        (12, 12, None, "group 0 covers tokens up to 0, the cache holds 12"),
    ],
    ids=["reference over own blocks", "all-shared file loses its reference"],
)
def test_global_blocks_must_start_where_the_prefix_ends(
    tmp_path: Path, n_tokens: int, shared: int, prefix: dict[str, Any] | None, reason: str
) -> None:
    path = write_cache_file(tmp_path, make_record(n_tokens=n_tokens, shared=shared)).path
    edit = add_before_checksum("prefix", prefix) if prefix else lambda h: h.pop("prefix")
    rewrite(path, header_edit=edit)
    with pytest.raises(CacheCorruptionError, match=re.escape(reason)):
        read_back(path)


def merge_first_checkpoint_blocks(record: CacheRecord) -> CacheRecord:
    """Checkpoint 0's group-1 blocks [2, 4) and [4, 6) as one block across the boundary at 4."""
    parts = [b for b in record.blocks if (b.checkpoint, b.group) == (0, 1)]
    keys, values = random_kv(4, 8, "float32"), random_kv(4, 6, "float32")
    merged = PersistedBlock(1, 2, 4, keys, values, checkpoint=0)
    return CacheRecord(record.header, (*[b for b in record.blocks if b not in parts], merged))


@pytest.mark.parametrize(
    ("broken", "reason"),
    [
        (lambda r: make_record(cuts=[Cut(6, "prefix", 1)]),
         "checkpoint 0 group 1 starts at token 1, before token 2: more than its window's blocks"),
        (merge_first_checkpoint_blocks,
         "block c0.g1.b2 holds [4] tokens, which does not fit one 4-token block"),
        (lambda r: CacheRecord(replace(r.header, checkpoints=[{"offset": 6}]), r.blocks),
         "header field checkpoints has a bad value"),
        (lambda r: CacheRecord(replace(r.header, checkpoints=[]), r.blocks),
         "tensors of checkpoint 0, which the header does not list"),
    ],
)
def test_writer_refuses_invalid_checkpoints(
    tmp_path: Path, broken: Callable[[CacheRecord], CacheRecord], reason: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(reason)):
        write_cache_file(tmp_path, broken(make_record(cuts=CUTS)))
    assert os.listdir(tmp_path) == []


def with_prefix(shared: int | None, key: Any = PREFIX_KEY) -> Callable[[CacheRecord], CacheRecord]:
    """The record with its header's prefix reference replaced (None: no reference)."""
    prefix = None if shared is None else {"key": key, "n_tokens": shared}
    return lambda record: CacheRecord(replace(record.header, prefix=prefix), record.blocks)


@pytest.mark.parametrize(
    ("shared", "broken", "reason"),
    [
        (0, with_prefix(8),
         "global group 0 starts at token 0, but with a prefix reference of 8 tokens "
         "it must start at token 8"),
        (8, with_prefix(None),
         "global group 0 starts at token 8, but with no prefix reference it must start at token 0"),
        (8, with_prefix(4),
         "global group 0 starts at token 8, but with a prefix reference of 4 tokens "
         "it must start at token 4"),
        (8, with_prefix(8, key="9F"), "header field prefix has a bad value"),
        (8, with_prefix(8, key=""), "header field prefix has a bad value"),
        (8, with_prefix(0), "header field prefix has a bad value"),
        (8, with_prefix(6), "header field prefix has n_tokens 6, not a multiple of the spec's "
                            "4-token blocks"),
        (8, with_prefix(12), "header field prefix has n_tokens 12, more than the cache's 10"),
    ],
)
def test_writer_refuses_blocks_that_do_not_match_the_prefix(
    tmp_path: Path, shared: int, broken: Callable[[CacheRecord], CacheRecord], reason: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(reason)):
        write_cache_file(tmp_path, broken(make_record(shared=shared)))
    assert os.listdir(tmp_path) == []


def test_wrong_model_is_named(tmp_path: Path) -> None:
    path = write_cache_file(tmp_path, make_record()).path
    reason = "cache made by model tiny@abababababababab, loaded model is other@cdcdcdcdcdcdcdcd"
    with pytest.raises(CacheCorruptionError, match=reason):
        read_cache_file(path, OTHER_MODEL.digest, spec_fingerprint(make_spec()),
                        expect_model_name=OTHER_MODEL.name)


def test_other_spec_is_named(tmp_path: Path) -> None:
    path = write_cache_file(tmp_path, make_record("float32")).path
    with pytest.raises(CacheCorruptionError, match="spec fingerprint mismatch"):
        read_back(path, "bfloat16")


def test_missing_and_non_regular_files(tmp_path: Path) -> None:
    with pytest.raises(CacheCorruptionError, match="unreadable"):
        read_header(tmp_path / "gone.safetensors")
    (tmp_path / "dir.safetensors").mkdir()
    with pytest.raises(CacheCorruptionError, match="not a regular file"):
        read_back(tmp_path / "dir.safetensors")
    os.mkfifo(tmp_path / "fifo.safetensors")
    with pytest.raises(CacheCorruptionError, match="not a regular file"):
        read_header(tmp_path / "fifo.safetensors")


# -- fuzzing -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def valid_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    directory = tmp_path_factory.mktemp("valid")
    return write_cache_file(directory, make_record("bfloat16"), sync=False).path.read_bytes()


@pytest.fixture(scope="module")
def fuzz_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "fuzz.safetensors"


def read_both(path: Path) -> CacheRecord:
    read_header(path)
    return read_cache_file(path, MODEL.digest, spec_fingerprint(make_spec("bfloat16")))


FUZZ = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
HEADER_START = struct.pack("<Q", 64) + b"{"  # random bytes behind a plausible header start


@FUZZ
@given(data=st.binary(max_size=4096), prefix=st.sampled_from([b"", HEADER_START]))
def test_random_bytes_only_raise_corruption(fuzz_path: Path, data: bytes, prefix: bytes) -> None:
    fuzz_path.write_bytes(prefix + data)
    with pytest.raises(CacheCorruptionError):
        read_both(fuzz_path)


@FUZZ
@given(st.data())
def test_any_single_byte_change_is_caught(
    fuzz_path: Path, valid_bytes: bytes, data: st.DataObject
) -> None:
    # The checksum covers every byte of the file but its own digits, and a
    # change to those digits breaks the match: no edit can pass.
    offset = data.draw(st.integers(0, len(valid_bytes) - 1), label="offset")
    flip = data.draw(st.integers(1, 255), label="xor")
    corrupted = bytearray(valid_bytes)
    corrupted[offset] ^= flip
    fuzz_path.write_bytes(bytes(corrupted))
    with pytest.raises(CacheCorruptionError):
        read_cache_file(fuzz_path, MODEL.digest, spec_fingerprint(make_spec("bfloat16")))
    try:
        read_header(fuzz_path)  # checks structure only: may pass, must not crash
    except CacheCorruptionError:
        pass


def test_every_header_bit_flip_is_caught(fuzz_path: Path, valid_bytes: bytes) -> None:
    """Exhaustive where it matters most: a flipped header byte could mislead the reader."""
    fingerprint = spec_fingerprint(make_spec("bfloat16"))
    for offset in range(8 + struct.unpack("<Q", valid_bytes[:8])[0]):
        corrupted = bytearray(valid_bytes)
        corrupted[offset] ^= 0x01
        fuzz_path.write_bytes(bytes(corrupted))
        with pytest.raises(CacheCorruptionError):
            read_cache_file(fuzz_path, MODEL.digest, fingerprint)


@FUZZ
@given(st.data())
def test_any_truncation_is_caught(fuzz_path: Path, valid_bytes: bytes, data: st.DataObject) -> None:
    fuzz_path.write_bytes(valid_bytes[: data.draw(st.integers(0, len(valid_bytes) - 1))])
    with pytest.raises(CacheCorruptionError):
        read_both(fuzz_path)


def test_valid_bytes_read_back(fuzz_path: Path, valid_bytes: bytes) -> None:
    fuzz_path.write_bytes(valid_bytes)
    assert read_both(fuzz_path).header.agent_id == AGENT


# -- the directory -------------------------------------------------------------------------------
def test_scan_indexes_good_files_lists_bad_ones_and_removes_stale_temps(tmp_path: Path) -> None:
    good = [write_cache_file(tmp_path, make_record(agent_id=f"agent-{i}")).path for i in range(3)]
    bad = tmp_path / "broken.safetensors"
    bad.write_bytes(b"\x01" * 20)
    dead_pid = spawn_and_reap()
    stale = tmp_path / f".agent-0-0123.{dead_pid}.abcd1234.tmp"
    old = tmp_path / f".agent-1-0123.{os.getpid()}.abcd1234.tmp"
    live = tmp_path / f".agent-2-0123.{os.getpid()}.abcd5678.tmp"
    for temp in (stale, old, live):
        temp.write_bytes(b"partial")
    os.utime(old, (0, 0))
    (tmp_path / "notes.txt").write_text("not a cache")
    result = scan_directory(tmp_path)
    assert sorted(h.agent_id for _, h in result.headers) == ["agent-0", "agent-1", "agent-2"]
    assert sorted(p for p, _ in result.headers) == sorted(good)
    assert [p for p, _ in result.bad] == [bad] and "absurd" in result.bad[0][1]
    assert not stale.exists() and not old.exists() and live.exists()


def spawn_and_reap() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_scan_of_a_missing_directory_is_empty(tmp_path: Path) -> None:
    assert scan_directory(tmp_path / "nowhere") == cache_file.ScanResult([], [])


def test_quarantine_moves_the_file_aside_with_its_reason(tmp_path: Path) -> None:
    path = write_cache_file(tmp_path, make_record()).path
    target = quarantine(path, "checksum mismatch \ud800")
    assert target is not None and target.parent == tmp_path / "quarantine"
    assert target.name.endswith(path.name)
    assert not path.exists()
    assert "checksum mismatch" in target.with_name(target.name + ".reason.txt").read_text()
    assert scan_directory(tmp_path).headers == []


def test_quarantine_deletes_what_it_cannot_move(tmp_path: Path) -> None:
    path = write_cache_file(tmp_path, make_record()).path
    (tmp_path / "quarantine").write_text("a file where the folder should be")
    assert quarantine(path, "bad") is None
    assert not path.exists()
    assert quarantine(tmp_path / "already-gone.safetensors", "bad") is None
