"""A writer killed mid-write, and a disk that really fills up, never leave a torn cache file.

Run as a script (``python test_cache_file_crash.py DIR``) this module is the
child writer: it rewrites one agent's ~100 MiB cache forever, printing each
generation after it lands, until the test SIGKILLs it.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from engine.domain.block_layout import block_spans
from engine.domain.cache_spec import ModelCacheSpec, group_layers
from engine.errors import CachePersistenceError
from engine.models.loaded import ModelIdentity
from engine.store.cache_file import (
    CacheRecord,
    PersistedBlock,
    new_header,
    read_cache_file,
    scan_directory,
    spec_fingerprint,
    write_cache_file,
)

MODEL = ModelIdentity("crash-model", "ef" * 32)
AGENT = "crash-agent"
KILLS = 5
MAX_KILLS = 30


def make_spec(n_layers: int) -> ModelCacheSpec:
    return ModelCacheSpec(
        n_layers=n_layers, n_kv_heads=8, head_dim=128, dtype="float32", block_tokens=256,
        groups=group_layers([None] * n_layers),
    )


def filled_record(spec: ModelCacheSpec, n_tokens: int, generation: int) -> CacheRecord:
    """Every value equals ``generation``, so a mix of two generations would show."""
    blocks = []
    for span in block_spans(0, n_tokens, spec.block_tokens):
        shape = (1, spec.n_kv_heads, span.length, spec.head_dim)
        layers = tuple(np.full(shape, generation, dtype=np.float32) for _ in range(spec.n_layers))
        blocks.append(PersistedBlock(0, span.start, span.length, layers, layers))
    header = new_header(AGENT, MODEL, spec, [generation] * n_tokens, ["KVCache"] * spec.n_layers,
                        [{}] * spec.n_layers, extra={"generation": generation})
    return CacheRecord(header, tuple(blocks))


def assert_whole(path: Path, spec: ModelCacheSpec, generations: set[int]) -> None:
    record = read_cache_file(path, MODEL.digest, spec_fingerprint(spec))
    generation = record.header.extra["generation"]
    assert generation in generations
    assert set(record.header.token_ids) == {generation}
    for block in record.blocks:
        for array in block.keys + block.values:
            assert (array == generation).all()


# -- the child writer ----------------------------------------------------------------------------
CHILD_SPEC = make_spec(n_layers=8)
CHILD_TOKENS = 1600  # 8 layers x 2 x 8 heads x 128 x 4 bytes x 1600 tokens = 100 MiB


def child_main(directory: Path) -> None:
    generation = 0
    while True:
        generation += 1
        write_cache_file(directory, filled_record(CHILD_SPEC, CHILD_TOKENS, generation))
        print(generation, flush=True)


# -- the tests -----------------------------------------------------------------------------------
def test_sigkill_mid_write_leaves_the_old_or_the_new_file(tmp_path: Path) -> None:
    rng = random.Random(1234)
    temps_seen = 0
    attempt = 0
    # At least KILLS kills, and on until one lands mid-write (a loaded machine may spend a kill's whole delay
    # filling the next record): up to MAX_KILLS.
    while attempt < KILLS or (temps_seen == 0 and attempt < MAX_KILLS):
        attempt += 1
        reported = kill_writer_mid_flight(tmp_path, delay=rng.uniform(0.0, 0.4))
        temps_seen += sum(name.endswith(".tmp") for name in os.listdir(tmp_path))
        result = scan_directory(tmp_path)
        assert result.bad == []
        assert [h.agent_id for _, h in result.headers] == [AGENT]
        assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")], "stale temp kept"
        # The killed write may have landed after its last report, never half of it.
        assert_whole(result.headers[0][0], CHILD_SPEC, {reported, reported + 1})
    # The child spends most of its time inside write_cache_file, so most kills
    # land mid-write and leave a temp file: proof the test hits the window.
    assert temps_seen >= 1


def kill_writer_mid_flight(directory: Path, delay: float) -> int:
    """Start the child, let one write land, SIGKILL it ``delay`` s later.

    Returns the last generation the child reported as written.
    """
    command = [sys.executable, __file__, str(directory)]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        first = child.stdout.readline()
        assert first.strip(), "child died before its first write"
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        rest = child.stdout.read().split()
    finally:
        child.kill()
        child.wait()
    return int((rest or [first])[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="tmpfs mounts are a Linux feature")
def test_real_disk_full_keeps_the_old_file(tmp_path: Path) -> None:
    spec = make_spec(n_layers=2)
    disk = tmp_path / "small-disk"
    # Imported here: this module also runs as a plain script (the SIGKILL child), without the repo on its path.
    from tests.support.tmpfs import tmpfs

    with tmpfs(disk, "2m"):
        small = write_cache_file(disk, filled_record(spec, 64, generation=1))  # 0.5 MiB
        with pytest.raises(CachePersistenceError, match="No space left on device"):
            write_cache_file(disk, filled_record(spec, 640, generation=2))  # 5 MiB
        assert os.listdir(disk) == [small.path.name]
        assert_whole(small.path, spec, {1})


if __name__ == "__main__":
    child_main(Path(sys.argv[1]))
