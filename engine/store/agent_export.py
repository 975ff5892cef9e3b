"""One agent as one file: export it from a cache directory, import it into another.

The export is an ordinary agent cache file (``cache_file.py``), not a new
format. A cache file already holds everything an agent needs, token ids,
every block, checkpoints, the model's digest and cache spec, under one crc32
over every byte, and its reader already validates each of those; a second
format would need a second reader, a second set of checks, and could drift.
Two things make a warm file an export:

- no prefix reference: the shared-prefix blocks the agent's warm file leaves
  to a file in ``prefixes/`` are inlined, so its full-attention groups start
  at token 0 and the file stands alone;
- the header's ``extra["export"]`` holds when it was exported and, when the
  agent has one, its direct-API conversation (the ConversationStore's own
  JSON), so the checksum covers the conversation too.

Importing validates the whole file (checksum, header, shapes) and its model
before anything is written; the warm file lands under the target model's
folder with ``extra["export"]`` dropped, byte for byte the file the warm tier
itself would write, so a server started on that directory indexes the agent
as warm and resumes it. A file copied by hand into a model folder works too.

These functions read and write files only; they never load a model or talk to
an engine. A server that serves the same directory must first write a hot
agent to disk (export), and index an imported one (its store scans at start).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engine.store.conversations import AgentConversation
from engine.domain.agent_ids import validate_agent_id
from engine.errors import (
    AgentExistsError,
    AgentModelMismatchError,
    AgentNotFoundError,
    CacheCorruptionError,
    InvalidAgentFileError,
    InvalidRequestError,
)

from engine.store.agents_on_disk import (
    COLD_INDEX,
    ModelKey,
    WarmFile,
    agents_root,
    cold_ids,
    conversation_store,
    find_warm,
    folder_model,
    prefix_file,
    turns_of,
)
from engine.store.cache_file import (CacheHeader, CacheRecord, cache_file_path, full_attention_groups, read_cache_file,
                                     read_header, write_cache_file, write_cache_file_to)
from engine.store.cold_index import ColdIndex

EXPORT_FIELD = "export"  # the header's ``extra`` key an export adds


@dataclass(frozen=True, slots=True)
class ExportSummary:
    agent_id: str
    path: Path
    model: str  # the ModelKey in words
    n_tokens: int
    nbytes: int
    conversation_turns: int | None
    inlined_prefix_tokens: int  # tokens whose blocks came from a shared prefix file
    also_in: tuple[str, ...]  # other models holding a cache of this agent (the newest was taken)


@dataclass(frozen=True, slots=True)
class ImportSummary:
    agent_id: str
    path: Path  # the warm file written
    model: str
    n_tokens: int
    nbytes: int
    conversation_turns: int | None
    replaced: bool


# -- export -------------------------------------------------------------------------------------
def export_agent(
    cache_dir: Path, agent_id: str, out_path: Path, model_key: ModelKey | str | None = None
) -> ExportSummary:
    """Write the agent's warm cache, shared prefix inlined, and its conversation to ``out_path``.

    ``model_key`` picks among model folders holding the agent: a ModelKey, or
    text naming the folder, the model or ``name@digest``; without one the
    most recently used cache is taken and the others are named in
    ``also_in``. Raises AgentNotFoundError without a cache on disk,
    CacheCorruptionError for a damaged one, CachePersistenceError when
    ``out_path`` cannot be written (an old file there is replaced atomically).
    """
    out_path = Path(out_path)
    if out_path.is_dir():
        raise InvalidRequestError(f"{out_path} is a directory; name the file to write", field="out_path")
    chosen, others = _choose(cache_dir, agent_id, model_key)
    record, inlined = _self_contained(chosen)
    conversation = conversation_store(cache_dir).get(agent_id)
    export: dict[str, Any] = {"exported_at": time.time(), "model_dir": chosen.model_dir.name}
    if conversation is not None:
        export["conversation"] = conversation.to_json()
    header = replace(record.header, prefix=None, extra={**record.header.extra, EXPORT_FIELD: export})
    written = write_cache_file_to(out_path, CacheRecord(header, record.blocks))
    return ExportSummary(agent_id, written.path, str(chosen.model), header.n_tokens, written.nbytes,
                         turns_of(conversation), inlined, tuple(str(f.model) for f in others))


def _choose(
    cache_dir: Path, agent_id: str, model_key: ModelKey | str | None
) -> tuple[WarmFile, list[WarmFile]]:
    found = find_warm(cache_dir, agent_id)
    if not found:
        raise AgentNotFoundError(agent_id, f"agent {agent_id!r} has no cache on disk in {agents_root(cache_dir)}")
    if model_key is not None:
        matching = [f for f in found if _names(f.model, model_key)]
        if not matching:
            held = ", ".join(str(f.model) for f in found)
            raise AgentNotFoundError(agent_id, f"agent {agent_id!r} has no cache for model {model_key}; "
                                               f"it has caches for {held}")
        found = matching
    # Newest first: last_used is when its cache last changed; mtime breaks ties.
    found.sort(key=lambda f: (f.header.last_used, f.path.stat().st_mtime), reverse=True)
    return found[0], found[1:]


def _names(model: ModelKey, key: ModelKey | str) -> bool:
    return model.same_cache(key) if isinstance(key, ModelKey) else model.named_by(key)


def _self_contained(warm: WarmFile) -> tuple[CacheRecord, int]:
    """The agent's validated record with the blocks it leaves to a shared prefix file joined in."""
    record = _read_validated(warm.path, warm.header)
    reference = record.header.prefix
    if reference is None:
        return record, 0
    path = prefix_file(warm.model_dir, reference["key"])
    if not path.is_file():
        raise CacheCorruptionError(f"{warm.path}: its shared prefix file {path.name} is gone")
    prefix = _read_validated(path, read_header(path))
    shared = reference["n_tokens"]
    if prefix.header.token_ids != record.header.token_ids[:shared]:
        raise CacheCorruptionError(f"shared prefix {path.name} does not hold agent "
                                   f"{warm.header.agent_id!r}'s first {shared} tokens")
    # Only full-attention groups' own blocks: the agent's file holds its sliding windows itself.
    globals_ = full_attention_groups(record.header.spec)
    inlined = tuple(b for b in prefix.blocks if b.group in globals_ and b.checkpoint is None)
    return CacheRecord(record.header, inlined + record.blocks), shared


def _read_validated(path: Path, header: CacheHeader) -> CacheRecord:
    """The whole file checked against the identity its own header claims (self-consistency)."""
    return read_cache_file(path, header.model_digest, header.spec_fingerprint,
                           expect_model_name=header.model_name)


# -- import -------------------------------------------------------------------------------------
def import_agent(
    cache_dir: Path, file: Path, new_id: str | None = None,
    expected_model_key: ModelKey | None = None, *, replace_existing: bool = False,
) -> ImportSummary:
    """Validate an exported agent and install it as a warm agent of ``cache_dir``.

    The target is ``expected_model_key``'s folder (the loaded model's, on a
    server); without one, the folder of the model that made the file, held to
    the cache layout of the files already there. Refuses (AgentModelMismatchError)
    a file of another model or layout, naming both; (InvalidAgentFileError) a
    damaged, tampered or not self-contained file; (AgentExistsError) an id the
    target already has, warm, cold or as a conversation, unless
    ``replace_existing``. Nothing on disk changes unless every check passes.
    """
    record, conversation = _read_export(Path(file))
    made_by = ModelKey.of_header(record.header)
    agent_id = record.header.agent_id if new_id is None else _valid_id(new_id)
    target_dir = _target_folder(cache_dir, agent_id, made_by, expected_model_key)
    existed = _exists(cache_dir, target_dir, agent_id)
    if existed and not replace_existing:
        raise AgentExistsError(agent_id)
    extra = {k: v for k, v in record.header.extra.items() if k != EXPORT_FIELD}
    header = replace(record.header, agent_id=agent_id, extra=extra)
    written = write_cache_file(target_dir, CacheRecord(header, record.blocks))
    try:
        _install_conversation(cache_dir, agent_id, conversation)
    except BaseException:
        if not existed:
            written.path.unlink(missing_ok=True)  # no half an agent: the cache goes with its conversation
        raise
    _forget_cold(target_dir, agent_id)
    return ImportSummary(agent_id, written.path, str(made_by), header.n_tokens, written.nbytes,
                         turns_of(conversation), existed)


def _read_export(file: Path) -> tuple[CacheRecord, AgentConversation | None]:
    """The file's record and conversation, every byte checked; InvalidAgentFileError otherwise."""
    try:
        record = _read_validated(file, read_header(file))
    except CacheCorruptionError as err:
        raise InvalidAgentFileError(f"not a valid agent export: {err}") from None
    if record.header.prefix is not None:
        raise InvalidAgentFileError(
            f"{file}: refers to a shared prefix file it does not hold; export the agent with "
            "`semantic agents export` to get a file that stands alone")
    export = record.header.extra.get(EXPORT_FIELD)
    if export is None or "conversation" not in export:
        return record, None
    try:
        conversation = AgentConversation.from_json(export["conversation"])
    except (ValueError, TypeError) as err:
        raise InvalidAgentFileError(f"{file}: its conversation is malformed ({err})") from None
    if conversation.agent_id != record.header.agent_id:
        raise InvalidAgentFileError(f"{file}: its conversation belongs to {conversation.agent_id!r}, "
                                    f"its cache to {record.header.agent_id!r}")
    return record, conversation


def _valid_id(new_id: str) -> str:
    # The API's own rule: an imported agent must be reachable at /v1/agents/{id}.
    return validate_agent_id(new_id, field="new_id")


def _target_folder(cache_dir: Path, agent_id: str, made_by: ModelKey, expected: ModelKey | None) -> Path:
    """The model folder the agent goes to; AgentModelMismatchError when the file cannot resume there."""
    target = expected if expected is not None else made_by
    folder = agents_root(cache_dir) / target.directory_name
    if expected is None:
        target = folder_model(folder) or made_by
    if not made_by.same_cache(target):
        raise AgentModelMismatchError(agent_id, str(made_by), str(target))
    return folder


def _exists(cache_dir: Path, folder: Path, agent_id: str) -> bool:
    return (cache_file_path(folder, agent_id).exists() or agent_id in cold_ids(folder)
            or conversation_store(cache_dir).get(agent_id) is not None)


def _install_conversation(cache_dir: Path, agent_id: str, conversation: AgentConversation | None) -> None:
    """The imported conversation replaces any old one; without one, an old one would not match the cache."""
    store = conversation_store(cache_dir)
    store.delete(agent_id)
    if conversation is not None:
        store.create(agent_id, conversation.system, conversation.display_name, conversation.messages)


def _forget_cold(folder: Path, agent_id: str) -> None:
    """A replaced cold entry would list the agent twice; it is warm now."""
    if agent_id not in cold_ids(folder):
        return
    cold = ColdIndex(folder / COLD_INDEX)
    cold.load()
    if cold.remove(agent_id):
        cold.save()
