"""One agent's KV cache as one safetensors file, written and read without MLX.

This package's ``__init__`` is the format's public face: code outside the
package imports from ``engine.store.cache_file`` only. Inside, the work is done
in ``format`` (constants, dtypes, records), ``header`` (the JSON header),
``validation`` (structural checks), ``writer``, ``reader`` and ``directory``
(scan and quarantine), whose un-underscored names are the package's internal
API; an underscored name stays in its own module.

Layout (plain safetensors, so ``mx.load`` and ``safetensors.safe_open`` read it):
an 8-byte little-endian header length, the JSON header padded with spaces so
tensor data starts 8-byte aligned, then the tensors' raw bytes in this order::

    token_ids                    U32 (n_tokens,)
    g{group}.b{start}.l{slot}.k  (1, kv_heads, length, head_dim)    per block, per layer slot
    g{group}.b{start}.l{slot}.v  (1, kv_heads, length, v_head_dim)
    c{i}.g{group}.b{start}.l{slot}.k / .v                           per checkpoint block

``group`` is the spec's layer group, ``start`` the block's first token (on a
block boundary), ``slot`` the layer's position within the group. Blocks are
ordered by group then start; K/V are F32, F16 or BF16 as the spec says. Each
group's blocks are contiguous and end at ``n_tokens``; a global group's begin
at token 0 (or where the prefix reference ends, below), a sliding-window
group's may begin later, but no later than its window needs. The tensors tile
the data section exactly: no gaps, no overlap, no trailing bytes.

Checkpoints are the sliding-window groups as they stood at an earlier offset
(the end of a turn's prompt, or of a prefix other agents share), so a
conversation can resume there after the windows have moved on. The header's
``checkpoints[i]`` is ``{"offset": o, "kind": "turn" | "prefix"}``, offsets
strictly increasing within ``1..n_tokens``; its blocks, named ``c{i}.``, follow
the cache's own blocks, ordered by checkpoint, group, then start. Checkpoint
``i`` has blocks of every sliding-window group and of no global group (those
never drop a token, so the cache's own blocks already hold them). Each group's
blocks sit on block boundaries, are contiguous, end exactly at ``o`` and begin
no later than ``o - (W - 1)`` and no earlier than ``o - round_up(W, block)``
(both at least 0), for window ``W``.

A prefix reference stands for a long prefix many agents share (a harness's
system prompt and tools), stored once as its own cache file of ``P`` tokens so
an agent's file need not repeat it. The header's ``prefix`` is
``{"key": k, "n_tokens": P}``: ``k`` is 1 to 64 lowercase hex digits naming
the prefix file, ``P`` at least 1, a multiple of the block size and at most
``n_tokens``. Every global group's own blocks then start at ``P`` rather than
0 (none at all when ``P == n_tokens``); sliding-window groups and checkpoints
are unaffected. ``token_ids`` still holds all ``n_tokens`` ids, the prefix's
included, so a reader can check that the prefix file's tokens match.

A recurrent layer group (linear attention, Mamba, RWKV: a model with
``"kind": "recurrent"`` groups in its spec) holds no positions but one state
per sequence: tensors ``g{group}.s{offset}.l{slot}.a{j}`` (shape ``(1, *shape)``
and dtype of the spec's ``state.arrays[j]``, never quantized), exactly one set
at ``n_tokens`` and, named ``c{i}.``, one at each checkpoint's offset (a
snapshot: where a later turn can resume). They sort with the K/V blocks by
checkpoint, group, then position.

``__metadata__`` holds ``format: semantic-agent-cache`` and ``semantic``: the
:class:`CacheHeader` as one JSON string (safetensors metadata is str -> str),
with the fields ``format_version``, ``agent_id``, ``model_name``,
``model_digest``, ``spec_fingerprint``, ``spec``, ``cache_classes``,
``cache_meta``, ``n_tokens``, ``checkpoints``, ``prefix``, ``created_at``,
``last_used``, ``tensor_bytes``, ``display_name``, ``source``, ``extra`` and,
always last, ``checksum``. ``checkpoints`` is written only when there are some
and ``prefix`` only when set: both came within format version 1, and a file
without them is byte for byte what the format wrote before them. A file is
read back only by the model with the same digest and spec fingerprint.

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

The write is atomic: the bytes go to ``.{stem}.{pid}.{hex}.tmp`` in the same
directory, are fsynced (F_FULLFSYNC on macOS) and renamed over
``{stem}.safetensors``, then the directory is synced; a crash leaves the old
file or the new one, never a torn one. :func:`scan_directory` removes temp
files whose writer is gone, and :func:`quarantine` moves bad files into
``quarantine/`` with the reason beside them.
"""

from __future__ import annotations

from engine.store.cache_file.directory import quarantine, scan_directory
from engine.store.cache_file.format import (
    CHECKPOINT_KINDS,
    CHECKSUM_ALGORITHM,
    QUANTIZATION_GROUP_SIZES,
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_HEADER_BYTES,
    QUARANTINE_DIR,
    STALE_TEMP_SECONDS,
    SUFFIX,
    TOKENS,
    CacheHeader,
    CacheRecord,
    KVQuantization,
    PersistedBlock,
    QuantizedArray,
    ScanResult,
    WrittenFile,
    cache_file_path,
    new_header,
    spec_fingerprint,
)
from engine.store.cache_file.reader import read_cache_file, read_header
from engine.store.cache_file.validation import full_attention_groups
from engine.store.cache_file.writer import write_cache_file, write_cache_file_to

__all__ = [
    "CHECKPOINT_KINDS",
    "CHECKSUM_ALGORITHM",
    "QUANTIZATION_GROUP_SIZES",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_HEADER_BYTES",
    "QUARANTINE_DIR",
    "STALE_TEMP_SECONDS",
    "SUFFIX",
    "TOKENS",
    "CacheHeader",
    "CacheRecord",
    "KVQuantization",
    "PersistedBlock",
    "QuantizedArray",
    "ScanResult",
    "WrittenFile",
    "cache_file_path",
    "full_attention_groups",
    "new_header",
    "quarantine",
    "read_cache_file",
    "read_header",
    "scan_directory",
    "spec_fingerprint",
    "write_cache_file",
    "write_cache_file_to",
]
