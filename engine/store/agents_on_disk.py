"""The agents a cache directory holds, found without loading a model or starting an engine.

The warm tier keeps one folder per model under ``<cache_dir>/agents`` (see
``warm_store.model_directory``): an agent's cache file, named by
``agent_file_stem``, a ``cold.json`` of agents whose cache was dropped, and
``prefixes/`` of shared prefix files. Direct-API conversations live apart, one
JSON per agent under ``<cache_dir>/conversations``, whichever model served them.

Only headers are read here (the start of each file), and nothing is written,
moved or quarantined: this runs beside a server that may own the same
folders, so a file it does not like is skipped, and the server decides.
"""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from engine.store.conversations import AgentConversation, ConversationStore
from engine.domain.cache_spec import ModelCacheSpec
from engine.errors import CacheCorruptionError
from engine.models.loaded import ModelIdentity

from engine.store.cache_file import SUFFIX, CacheHeader, cache_file_path, read_header, spec_fingerprint
from engine.store.file_names import AGENT_PREFIX, model_dir_name

AGENTS_DIR = "agents"
CONVERSATIONS_DIR = "conversations"
PREFIXES_DIR = "prefixes"
COLD_INDEX = "cold.json"


@dataclass(frozen=True, slots=True)
class ModelKey:
    """The model and cache layout that made a cache: it resumes only under the same two.

    ``digest`` names the weights, ``spec_fingerprint`` the cache layout (block
    size, KV dtype, layer groups); ``name`` and the spec's block size and dtype
    are there so an error can say in words which model is which.
    """

    name: str
    digest: str
    spec_fingerprint: str
    block_tokens: int | None = None
    kv_dtype: str | None = None

    @classmethod
    def of_header(cls, header: CacheHeader) -> ModelKey:
        block = header.spec.get("block_tokens")
        dtype = header.spec.get("dtype")
        return cls(header.model_name, header.model_digest, header.spec_fingerprint,
                   block if type(block) is int else None, dtype if type(dtype) is str else None)

    @classmethod
    def of_model(cls, identity: ModelIdentity, spec: ModelCacheSpec) -> ModelKey:
        """The loaded model's key (``loaded.identity``, ``loaded.spec``), for the HTTP endpoints."""
        return cls(identity.name, identity.digest, spec_fingerprint(spec), spec.block_tokens, spec.dtype)

    @property
    def directory_name(self) -> str:
        return model_dir_name(self.name, self.digest)

    @property
    def short(self) -> str:
        return ModelIdentity(self.name, self.digest).key

    def same_cache(self, other: ModelKey) -> bool:
        return self.digest == other.digest and self.spec_fingerprint == other.spec_fingerprint

    def named_by(self, text: str) -> bool:
        """``--model`` may give the folder name, the model name, or ``name@digest``."""
        return text in (self.directory_name, self.name, self.short)

    def __str__(self) -> str:
        layout = f"{self.block_tokens}-token {self.kv_dtype} blocks, " if self.block_tokens else ""
        return f"{self.short} ({layout}cache spec {self.spec_fingerprint[:12]})"


class DiskTier(enum.Enum):
    WARM = "warm"  # its KV cache is on disk and resumes
    COLD = "cold"  # listed, its cache was dropped: the next turn prefills
    NONE = "none"  # a conversation that never left a cache (created, never ran)


@dataclass(frozen=True, slots=True)
class WarmFile:
    path: Path
    header: CacheHeader  # token ids included
    model: ModelKey

    @property
    def model_dir(self) -> Path:
        return self.path.parent


@dataclass(frozen=True, slots=True)
class AgentOnDisk:
    agent_id: str
    tier: DiskTier
    model_dir: str | None  # the folder under agents/, None for a conversation alone
    model: str | None  # ``name@digest``
    n_tokens: int
    nbytes: int  # the cache file's size; 0 when there is none
    conversation_turns: int | None  # user messages, None without a conversation
    last_written: float | None  # the cache (or conversation) file's mtime


# -- folders ------------------------------------------------------------------------------------
def agents_root(cache_dir: Path) -> Path:
    return Path(cache_dir) / AGENTS_DIR


def conversations_dir(cache_dir: Path) -> Path:
    return Path(cache_dir) / CONVERSATIONS_DIR


def model_dirs(cache_dir: Path) -> list[Path]:
    root = agents_root(cache_dir)
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def prefix_file(model_dir: Path, key: str) -> Path:
    return cache_file_path(model_dir / PREFIXES_DIR, AGENT_PREFIX + key)


# -- warm files ---------------------------------------------------------------------------------
def warm_files(model_dir: Path) -> Iterator[WarmFile]:
    """Every readable agent cache file in one model folder (temp files and bad files skipped)."""
    try:
        names = sorted(os.listdir(model_dir))
    except OSError:
        return
    for name in names:
        if name.endswith(SUFFIX) and not name.startswith("."):
            found = _warm_file(model_dir / name)
            if found is not None:
                yield found


def find_warm(cache_dir: Path, agent_id: str) -> list[WarmFile]:
    """The agent's cache file in each model folder that has one."""
    found = (_warm_file(cache_file_path(d, agent_id)) for d in model_dirs(cache_dir))
    return [f for f in found if f is not None and f.header.agent_id == agent_id]


def folder_model(model_dir: Path) -> ModelKey | None:
    """The model and layout a folder's agents were cached with: its newest file's, None when empty.

    A server quarantines files of another layout at start, so the newest file
    speaks for the folder; an empty folder has no layout to hold anyone to.
    """
    files = sorted(warm_files(model_dir), key=lambda f: f.header.last_used)
    return files[-1].model if files else None


def _warm_file(path: Path) -> WarmFile | None:
    try:
        if not path.is_file():
            return None
        header = read_header(path)
    except (CacheCorruptionError, OSError):
        return None
    return WarmFile(path, header, ModelKey.of_header(header))


# -- cold agents and conversations ------------------------------------------------------------
def cold_ids(model_dir: Path) -> dict[str, dict]:
    """The folder's cold agents by id, as ``cold.json`` lists them (unreadable: none)."""
    try:
        raw = json.loads((model_dir / COLD_INDEX).read_text(encoding="utf-8"))
        return {item["agent_id"]: item for item in raw.get("agents", []) if isinstance(item, dict)}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return {}


def conversation_store(cache_dir: Path) -> ConversationStore:
    return ConversationStore(conversations_dir(cache_dir))


def turns_of(conversation: AgentConversation | None) -> int | None:
    return None if conversation is None else sum(m.role == "user" for m in conversation.messages)


# -- the listing --------------------------------------------------------------------------------
def list_agents(cache_dir: Path) -> list[AgentOnDisk]:
    """Every agent on disk: one row per model folder holding it, plus conversations alone.

    Sorted by id, then model folder.
    """
    conversations = {c.agent_id: c for c in conversation_store(cache_dir).all()}
    rows: list[AgentOnDisk] = []
    for folder in model_dirs(cache_dir):
        warm = {f.header.agent_id: f for f in warm_files(folder)}
        rows += [_warm_row(f, conversations.get(i)) for i, f in warm.items()]
        rows += [_cold_row(folder, item, conversations.get(i))
                 for i, item in cold_ids(folder).items() if i not in warm]
    listed = {row.agent_id for row in rows}
    rows += [_conversation_row(c) for i, c in conversations.items() if i not in listed]
    return sorted(rows, key=lambda r: (r.agent_id, r.model_dir or ""))


def _warm_row(found: WarmFile, conversation: AgentConversation | None) -> AgentOnDisk:
    stat = found.path.stat()
    return AgentOnDisk(found.header.agent_id, DiskTier.WARM, found.model_dir.name, found.model.short,
                       found.header.n_tokens, stat.st_size, turns_of(conversation), stat.st_mtime)


def _cold_row(folder: Path, item: dict, conversation: AgentConversation | None) -> AgentOnDisk:
    n_tokens = item.get("n_tokens")
    last = item.get("last_used")
    return AgentOnDisk(item["agent_id"], DiskTier.COLD, folder.name, None,
                       n_tokens if type(n_tokens) is int else 0, 0, turns_of(conversation),
                       float(last) if type(last) in (int, float) else None)


def _conversation_row(conversation: AgentConversation) -> AgentOnDisk:
    return AgentOnDisk(conversation.agent_id, DiskTier.NONE, None, None, 0, 0,
                       turns_of(conversation), conversation.updated_at)
