"""The JSON header of a cache file: encoded by the writer, parsed and checked by the reader.

Both directions live here so the writer can run the reader's own field checks
on what it is about to write: a record that would not read back is refused
before a byte reaches the disk. Parsing trusts nothing (duplicate keys, NaN,
wrong types, unknown fields are all corruption), because the bytes may be torn.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Any

from engine.errors import CacheCorruptionError

from engine.store.cache_file.format import (
    AFTER_CHECKSUM,
    BY_CODE,
    CHECKSUM_VALUE,
    CRC_DIGITS,
    LENGTH,
    PREFIX_KEY,
    CHECKPOINT_KINDS,
    CHECKSUM_ALGORITHM,
    FORMAT_NAME,
    QUANTIZATION_BITS,
    QUANTIZATION_GROUP_SIZES,
    QUANTIZED_FORMAT_VERSION,
    READABLE_VERSIONS,
    CacheHeader,
    Entry,
    short_quote,
)


# -- field checks ----------------------------------------------------------------------------
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


def _is_checkpoint(v: Any) -> bool:
    return (type(v) is dict and set(v) == {"offset", "kind"} and _is_count(v["offset"])
            and v["kind"] in CHECKPOINT_KINDS)


def _is_prefix(v: Any) -> bool:
    # Never null: a file without a prefix reference has no prefix field at all.
    return (type(v) is dict and set(v) == {"key", "n_tokens"}
            and type(v["key"]) is str and PREFIX_KEY.fullmatch(v["key"]) is not None
            and type(v["n_tokens"]) is int and v["n_tokens"] >= 1)


def _is_quantization(v: Any) -> bool:
    # Never null, like prefix: a full-precision file has no kv_quantization field.
    return (type(v) is dict and set(v) - {"groups"} == {"bits", "group_size"}
            and v["bits"] in QUANTIZATION_BITS and type(v["bits"]) is int
            and v["group_size"] in QUANTIZATION_GROUP_SIZES and type(v["group_size"]) is int
            and ("groups" not in v or (type(v["groups"]) is list and len(v["groups"]) > 0
                                       and all(_is_count(g) for g in v["groups"]))))


# The header's JSON fields, in the order written; token ids travel as a tensor.
_HEADER_FIELDS = {
    "format_version": _is_count, "agent_id": _is_str, "model_name": _is_str,
    "model_digest": _is_str, "spec_fingerprint": _is_str, "spec": _is_dict,
    "cache_classes": _is_list_of(_is_str), "cache_meta": _is_list_of(_is_dict),
    "n_tokens": _is_count, "checkpoints": _is_list_of(_is_checkpoint), "prefix": _is_prefix,
    "created_at": _is_time, "last_used": _is_time,
    "tensor_bytes": _is_count, "display_name": _is_optional_str, "source": _is_optional_str,
    "extra": _is_dict, "kv_quantization": _is_quantization, "checksum": _is_str,
}
# Fields added within format version 1 are written only when they differ from
# their default, so a file without them is byte-identical to one written
# before they existed, and that older file still reads.
# kv_quantization came with format version 2 and is written exactly when the version is 2.
_OPTIONAL_FIELDS: dict[str, Callable[[], Any]] = {
    "checkpoints": list, "prefix": lambda: None, "kv_quantization": lambda: None,
}


# -- encoding ----------------------------------------------------------------------------------
def encode_head(header: CacheHeader, entries: Sequence[Entry]) -> tuple[bytes, int]:
    """The length prefix and padded JSON header, and the file offset of the checksum digits."""
    table: dict[str, Any] = {
        e.name: {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [e.begin, e.end]}
        for e in entries
    }
    fields = {
        name: getattr(header, name) for name in _HEADER_FIELDS
        if name != "checksum" and not _is_default(name, getattr(header, name))
    }
    fields["checksum"] = header.checksum  # last: see AFTER_CHECKSUM
    semantic = json.dumps(fields, allow_nan=False, separators=(",", ":"))
    _check_fields(json.loads(semantic))  # what the reader will see
    table["__metadata__"] = {"format": FORMAT_NAME, "semantic": semantic}
    text = json.dumps(table, separators=(",", ":")).encode("ascii")
    # Spaces pad the header so tensor data starts 8-byte aligned, as safetensors does.
    padded = text + b" " * (-(LENGTH.size + len(text)) % 8)
    checksum_at = LENGTH.size + len(text) - len(AFTER_CHECKSUM) - CRC_DIGITS
    return LENGTH.pack(len(padded)) + padded, checksum_at


def _is_default(name: str, value: Any) -> bool:
    return name in _OPTIONAL_FIELDS and value == _OPTIONAL_FIELDS[name]()


# -- parsing -----------------------------------------------------------------------------------
def parse_header(metadata: Any) -> CacheHeader:
    """The :class:`CacheHeader` in ``__metadata__``, token ids still empty."""
    if type(metadata) is not dict or "format" not in metadata:
        raise CacheCorruptionError("no format in the metadata: not a semantic agent cache")
    if metadata["format"] != FORMAT_NAME:
        raise CacheCorruptionError(
            f"unknown format {short_quote(repr(metadata['format']))}, expected {FORMAT_NAME!r}")
    if type(metadata.get("semantic")) is not str:
        raise CacheCorruptionError("no semantic header in the metadata")
    fields = parse_json(metadata["semantic"], "semantic header")
    if type(fields) is not dict:
        raise CacheCorruptionError("bad JSON semantic header: not an object")
    version = fields.get("format_version")
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise CacheCorruptionError(
            f"unsupported format_version {short_quote(repr(version))} "
            f"(this build reads {', '.join(map(str, READABLE_VERSIONS))})")
    _check_fields(fields)
    fields["created_at"] = float(fields["created_at"])
    fields["last_used"] = float(fields["last_used"])
    return CacheHeader(token_ids=[], **fields)


def _check_fields(fields: dict[str, Any]) -> None:
    missing = sorted(set(_HEADER_FIELDS) - set(_OPTIONAL_FIELDS) - set(fields))
    unknown = sorted(set(fields) - set(_HEADER_FIELDS))
    if missing or unknown:
        raise CacheCorruptionError(f"header fields missing {missing}, unknown {short_quote(unknown)}")
    for name, valid in _HEADER_FIELDS.items():
        if name in fields and not valid(fields[name]):
            raise CacheCorruptionError(
                f"header field {name} has a bad value {short_quote(repr(fields[name]))}")
    _check_checkpoint_offsets(fields.get("checkpoints", []), fields["n_tokens"])
    _check_prefix(fields.get("prefix"), fields["n_tokens"], fields["spec"])
    quantized = "kv_quantization" in fields
    if quantized != (fields["format_version"] == QUANTIZED_FORMAT_VERSION):
        raise CacheCorruptionError(
            f"format_version {fields['format_version']} {'with' if quantized else 'without'} kv_quantization "
            f"(version {QUANTIZED_FORMAT_VERSION} files and only they are quantized)")
    if not CHECKSUM_VALUE.fullmatch(fields["checksum"]):
        raise CacheCorruptionError(
            f"unsupported checksum {short_quote(repr(fields['checksum']))}, "
            f"expected {CHECKSUM_ALGORITHM}")


def _check_checkpoint_offsets(checkpoints: list[dict[str, Any]], n_tokens: int) -> None:
    """Checkpoints are earlier states of this cache: one per offset, in order, within it."""
    offsets = [c["offset"] for c in checkpoints]
    if any(after <= before for before, after in pairwise(offsets)):
        raise CacheCorruptionError(
            f"header field checkpoints has offsets {short_quote(offsets)}, not strictly increasing")
    outside = [o for o in offsets if not 1 <= o <= n_tokens]
    if outside:
        raise CacheCorruptionError(f"header field checkpoints has offset {outside[0]}, "
                                   f"outside 1..{n_tokens} (n_tokens)")


def _check_prefix(prefix: dict[str, Any] | None, n_tokens: int, spec: dict[str, Any]) -> None:
    """A prefix reference stands for whole blocks at the start of this cache, never more."""
    if prefix is None:
        return
    shared, block = prefix["n_tokens"], spec.get("block_tokens")
    if type(block) is not int or block < 1:
        raise CacheCorruptionError(f"header field prefix cannot be checked: the spec's "
                                   f"block_tokens is {short_quote(repr(block))}")
    if shared % block:
        raise CacheCorruptionError(f"header field prefix has n_tokens {shared}, "
                                   f"not a multiple of the spec's {block}-token blocks")
    if shared > n_tokens:
        raise CacheCorruptionError(f"header field prefix has n_tokens {shared}, "
                                   f"more than the cache's {n_tokens} (n_tokens)")


def parse_entry(name: str, desc: Any) -> Entry:
    """One tensor's table entry, whose byte span must match its dtype and shape exactly."""
    tensor = f"tensor {short_quote(repr(name))}"
    if type(desc) is not dict or set(desc) != {"dtype", "shape", "data_offsets"}:
        raise CacheCorruptionError(f"{tensor} has a malformed entry")
    dtype, shape, offsets = desc["dtype"], desc["shape"], desc["data_offsets"]
    if type(dtype) is not str or dtype not in BY_CODE:
        raise CacheCorruptionError(f"{tensor} has unexpected dtype {short_quote(repr(dtype))}")
    if not _is_list_of(_is_count)(shape) or len(shape) > 8:
        raise CacheCorruptionError(f"{tensor} has a bad shape {short_quote(shape)}")
    if not _is_list_of(_is_count)(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
        raise CacheCorruptionError(f"{tensor} has bad data_offsets {short_quote(offsets)}")
    needed, span = math.prod(shape) * BY_CODE[dtype].itemsize, offsets[1] - offsets[0]
    if span != needed:
        raise CacheCorruptionError(
            f"{tensor}: {dtype} {shape} needs {needed} bytes, its data_offsets span {span}")
    return Entry(name, dtype, tuple(shape), offsets[0], offsets[1])


def checksum_offset(head: bytes, checksum: str) -> int:
    """Where the checksum digits sit in ``head``; they must be the header's last bytes."""
    body = head.rstrip(b" ")
    if not body.endswith(checksum.encode("ascii") + AFTER_CHECKSUM):
        raise CacheCorruptionError("the checksum is not the header's last field")
    return len(body) - len(AFTER_CHECKSUM) - CRC_DIGITS


def parse_json(text: bytes | str, what: str) -> Any:
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as err:
        raise CacheCorruptionError(f"bad JSON {what}: {short_quote(err)}") from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # A duplicated key would let two readers disagree on which value counts.
    table = dict(pairs)
    if len(table) != len(pairs):
        raise ValueError("duplicate keys")
    return table


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")
