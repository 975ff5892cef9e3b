"""Message histories of the direct agent API (``/v1/agents/{id}/messages``).

The server, not the client, keeps these conversations: each turn is the
stored history plus one new user message, so every turn's prompt extends the
previous one and the agent's KV cache is reused to the last token.

One small JSON file per agent under ``<cache_dir>/conversations``, named by
``agent_file_stem`` (ids are client input; the stem is always a safe file
name, and the full id is stored inside). Writes are atomic: a temp file in
the same directory, fsync, ``os.replace``; a crash leaves the old file or the
new one. Files are read lazily; an unreadable or inconsistent file is
skipped with a warning and never stops the server.

Route handlers call the ``a*`` methods, which do the file work (reads, and
writes that fsync) on worker threads, never on the event loop; a lock
guards the loaded conversations between those threads.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import threading
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import AgentExistsError, CachePersistenceError
from engine.store.file_names import agent_file_stem
from engine.store.atomic_text import write_text_atomically

from engine.domain.chat import ChatMessage, Conversation, ImagePart, Part

log = logging.getLogger("semantic.api")

FORMAT_VERSION = 1
SUFFIX = ".json"
_ROLES = ("user", "assistant")


@dataclass(slots=True)
class AgentConversation:
    agent_id: str
    display_name: str | None = None
    system: str | None = None
    messages: list[ChatMessage] = field(default_factory=list)
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    # A fork of another client's agent (Claude Code, an OpenAI session): the token ids of the
    # context it continues, which no message list here can render; its messages follow them.
    context_tokens: list[int] | None = None

    def with_user_message(self, user: str | ChatMessage) -> Conversation:
        """The prompt of the next turn: system, the whole history, the new message (its text, or the message
        with its images)."""
        system = (ChatMessage("system", self.system),) if self.system else ()
        message = user if isinstance(user, ChatMessage) else ChatMessage("user", user)
        return Conversation((*system, *self.messages, message))

    def to_json(self) -> dict[str, Any]:
        return {
            "version": FORMAT_VERSION,
            "agent_id": self.agent_id,
            "display_name": self.display_name,
            "system": self.system,
            "messages": [_message_json(m) for m in self.messages],
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            **({"context_tokens": self.context_tokens} if self.context_tokens is not None else {}),
        }

    @classmethod
    def from_json(cls, data: Any) -> "AgentConversation":
        """Raises ValueError for anything but a well-formed version-1 record."""
        if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
            raise ValueError("not a version 1 conversation record")
        return cls(
            agent_id=_typed(data.get("agent_id"), str, "agent_id"),
            display_name=_optional_str(data.get("display_name"), "display_name"),
            system=_optional_str(data.get("system"), "system"),
            messages=[_message(item) for item in _typed(data.get("messages"), list, "messages")],
            created_at=float(_typed(data.get("created_at"), (int, float), "created_at")),
            updated_at=float(_typed(data.get("updated_at"), (int, float), "updated_at")),
            context_tokens=_token_ids(data.get("context_tokens")),
        )


def _typed(value: Any, kind: type | tuple[type, ...], name: str) -> Any:
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"{name} has the wrong type")
    return value


def _optional_str(value: Any, name: str) -> str | None:
    return None if value is None else _typed(value, str, name)


def _token_ids(value: Any) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(type(t) is int and t >= 0 for t in value):
        raise ValueError("context_tokens must be a list of token ids")
    return value


def _message_json(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.reasoning:
        out["reasoning"] = message.reasoning
    if message.parts:  # a message with images: its parts in order, each image's bytes as base64
        out["parts"] = [{"type": "image", "media_type": p.media_type, "data": base64.b64encode(p.data).decode()}
                        if isinstance(p, ImagePart) else {"type": "text", "text": p} for p in message.parts]
    return out


def _message(item: Any) -> ChatMessage:
    if not isinstance(item, dict) or item.get("role") not in _ROLES:
        raise ValueError("a message needs role user or assistant")
    return ChatMessage(item["role"], _typed(item.get("content"), str, "content"),
                       reasoning=_typed(item.get("reasoning", ""), str, "reasoning"),
                       parts=tuple(_part(p) for p in _typed(item.get("parts", []), list, "parts")))


def _part(item: Any) -> Part:
    if isinstance(item, dict) and item.get("type") == "text":
        return _typed(item.get("text"), str, "text")
    if isinstance(item, dict) and item.get("type") == "image":
        data = base64.b64decode(_typed(item.get("data"), str, "data"), validate=True)
        return ImagePart(data, _typed(item.get("media_type", ""), str, "media_type"), "images")
    raise ValueError("a part is a text or an image")


class ConversationStore:
    """Conversation files; the ``a*`` methods do the file work off the event loop.

    File work runs on worker threads (it fsyncs), so the loaded conversations
    are guarded by a lock; the busy set is touched only on the event loop.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._loaded: dict[str, AgentConversation] = {}
        self._busy: set[str] = set()
        self._lock = threading.RLock()

    # -- off the event loop -----------------------------------------------------------------
    async def aget(self, agent_id: str) -> AgentConversation | None:
        return await asyncio.to_thread(self.get, agent_id)

    async def aall(self) -> list[AgentConversation]:
        return await asyncio.to_thread(self.all)

    async def acreate(self, agent_id: str, system: str | None, display_name: str | None) -> AgentConversation:
        return await asyncio.to_thread(self.create, agent_id, system, display_name)

    async def acopy(self, source: AgentConversation, agent_id: str, display_name: str | None,
                    messages: list[ChatMessage]) -> AgentConversation:
        return await asyncio.to_thread(self.create, agent_id, source.system, display_name, messages,
                                       source.context_tokens)

    async def acreate_on_context(self, agent_id: str, display_name: str | None,
                                 context_tokens: list[int]) -> AgentConversation:
        return await asyncio.to_thread(self.create, agent_id, None, display_name, [], context_tokens)

    async def atruncate(self, agent_id: str, n_messages: int) -> None:
        await asyncio.to_thread(self.truncate, agent_id, n_messages)

    async def arecord_turn(self, agent_id: str, user: str | ChatMessage, reply: str, reasoning: str = "") -> None:
        await asyncio.to_thread(self.record_turn, agent_id, user, reply, reasoning)

    async def adelete(self, agent_id: str) -> bool:
        return await asyncio.to_thread(self.delete, agent_id)

    # -- reading ----------------------------------------------------------------------------
    def get(self, agent_id: str) -> AgentConversation | None:
        with self._lock:
            if agent_id not in self._loaded:
                found = self._read(self._path(agent_id))
                if found is None or found.agent_id != agent_id:
                    return None
                self._loaded[agent_id] = found
            return self._loaded[agent_id]

    def forget_loaded(self, agent_id: str) -> None:
        """Read the agent's file again on next use (another writer replaced it: an import)."""
        with self._lock:
            self._loaded.pop(agent_id, None)

    def __contains__(self, agent_id: str) -> bool:
        return self.get(agent_id) is not None

    def all(self) -> list[AgentConversation]:
        """Every stored conversation, reading the files not loaded yet."""
        with self._lock:
            known = {agent_file_stem(agent_id) for agent_id in self._loaded}
            for path in sorted(self.directory.glob(f"*{SUFFIX}")):
                if path.stem not in known and (found := self._read(path)) is not None:
                    self._loaded.setdefault(found.agent_id, found)
            return sorted(self._loaded.values(), key=lambda c: c.created_at)

    # -- writing ----------------------------------------------------------------------------
    def create(self, agent_id: str, system: str | None, display_name: str | None,
               messages: list[ChatMessage] | None = None,
               context_tokens: list[int] | None = None) -> AgentConversation:
        """A new conversation (a fork's starts with messages); AgentExistsError when one exists
        (two creates at once: one wins)."""
        with self._lock:
            if self.get(agent_id) is not None:
                raise AgentExistsError(agent_id)
            conversation = AgentConversation(agent_id, display_name, system, list(messages or []),
                                             context_tokens=context_tokens)
            self._write(conversation)
            self._loaded[agent_id] = conversation
            return conversation

    def record_turn(self, agent_id: str, user: str | ChatMessage, reply: str, reasoning: str = "") -> None:
        with self._lock:
            conversation = self.get(agent_id)
            if conversation is None:
                return  # deleted while the turn ran: nothing to add to
            message = user if isinstance(user, ChatMessage) else ChatMessage("user", user)
            conversation.messages += [message, ChatMessage("assistant", reply, reasoning=reasoning)]
            conversation.updated_at = time.time()
            self._write(conversation)

    def truncate(self, agent_id: str, n_messages: int) -> None:
        """Keep the first ``n_messages`` (a rewind)."""
        with self._lock:
            conversation = self.get(agent_id)
            if conversation is None or len(conversation.messages) <= n_messages:
                return
            conversation.messages = conversation.messages[:n_messages]
            conversation.updated_at = time.time()
            self._write(conversation)

    def delete(self, agent_id: str) -> bool:
        with self._lock:
            existed = self.get(agent_id) is not None
            self._loaded.pop(agent_id, None)
            with suppress(FileNotFoundError):
                self._path(agent_id).unlink()
            return existed

    # -- one turn at a time per agent ---------------------------------------------------------
    def claim(self, agent_id: str) -> bool:
        """Reserve the agent for one turn; False when a turn is already running on it."""
        if agent_id in self._busy:
            return False
        self._busy.add(agent_id)
        return True

    def release(self, agent_id: str) -> None:
        self._busy.discard(agent_id)

    def is_busy(self, agent_id: str) -> bool:
        return agent_id in self._busy

    # -- files --------------------------------------------------------------------------------
    def _path(self, agent_id: str) -> Path:
        return self.directory / f"{agent_file_stem(agent_id)}{SUFFIX}"

    def _read(self, path: Path) -> AgentConversation | None:
        try:
            found = AgentConversation.from_json(json.loads(path.read_text(encoding="utf-8")))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            log.warning("ignoring unreadable conversation file %s: %s", path, exc)
            return None
        if path.stem != agent_file_stem(found.agent_id):
            log.warning("ignoring conversation file %s: it holds agent %r", path, found.agent_id)
            return None
        return found

    def _write(self, conversation: AgentConversation) -> None:
        final = self._path(conversation.agent_id)
        # ASCII escapes keep lone surrogates (valid in JSON input) readable back as UTF-8.
        payload = json.dumps(conversation.to_json(), ensure_ascii=True, indent=1)
        try:
            write_text_atomically(final, payload)
        except OSError as exc:
            raise CachePersistenceError(f"cannot write conversation {final}: {exc}") from exc
