"""What each agent's recent replies reasoned, for clients that send a reply back without its reasoning.

Claude Code (2.1.197, measured here) sends its earlier replies back with no
thinking block at all, even inside a tool loop; other clients drop the
reasoning fields they do not know. A chat template that renders the current
tool loop's reasoning (Qwen3's, GLM's, Gemma 4's) then renders those replies
without it, so the prompt leaves the agent's cache where the reasoning was.
The reply's reasoning is still this server's record: it is kept here when
the turn ends, under the agent and the reply itself (its text, its calls'
names and arguments: what the client sends back), and given back to the
template when the same reply comes back without one. A reply that carries
its own reasoning (a thinking block, a signature, an encrypted item) is
used as it is.

In memory only and bounded: after a restart, or for a reply this server did
not write, nothing is restored, and the turn resumes where that reply
began (GenerationRequest.reply_start), as it would without this.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import replace

from engine.domain.chat import ChatMessage, Conversation, ToolCall

CAPACITY = 4096  # replies kept, across agents, least recently seen dropped first


def _key(agent_id: str, text: str, calls: tuple[ToolCall, ...] | list[ToolCall]) -> str:
    shape = [agent_id, text.strip(), [[c.name, c.arguments] for c in calls]]
    return hashlib.sha256(json.dumps(shape, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


class ReasoningRecall:
    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self._kept: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()  # routes record from the event loop and restore from worker threads

    def remember(self, agent_id: str, text: str, calls: list[ToolCall], reasoning: str) -> None:
        if not reasoning:
            return
        with self._lock:
            key = _key(agent_id, text, calls)
            self._kept[key] = reasoning
            self._kept.move_to_end(key)
            while len(self._kept) > self.capacity:
                self._kept.popitem(last=False)

    def restore(self, agent_id: str, conversation: Conversation) -> Conversation:
        """``conversation`` with each assistant reply that came back without reasoning given the reasoning this
        server recorded for it, if any."""
        messages = tuple(self._restored(agent_id, m) for m in conversation.messages)
        return conversation if messages == conversation.messages else replace(conversation, messages=messages)

    def _restored(self, agent_id: str, message: ChatMessage) -> ChatMessage:
        if message.role != "assistant" or message.reasoning:
            return message
        with self._lock:
            reasoning = self._kept.get(_key(agent_id, message.content, message.tool_calls))
        return replace(message, reasoning=reasoning) if reasoning else message

    def __len__(self) -> int:
        return len(self._kept)
