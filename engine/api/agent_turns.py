"""One stateful turn of the direct agent API: the stored history plus a new
user message in, the reply out, the history extended only when the turn
finished normally (stop, stop sequence or length; never after an error or a
cancellation, so a failed turn can simply be retried).

Streaming uses named SSE events: ``token`` (``{"text": ...}``) per delta,
then ``done`` with the same object a non-streaming call returns, or
``error`` with the app's error shape for ``/v1/agents``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from engine.errors import SemanticError
from engine.domain.requests import AgentSource, EngineEvent, FinishEvent, TokenEvent, Usage

from .admission import KEEP_ALIVE, failed, finish_error, replay
from .agents_schemas import MessageBody
from .async_turn import AsyncTurn
from engine.store.conversations import AgentConversation, ConversationStore
from .errors import ApiError, from_domain, stream_error_payload
from .identity import AgentIdentity
from .openai_translate import stops_of
from .output_formats import openai_response_format
from .service import EngineService
from engine.domain.chat import ChatMessage
from .turns import SamplingAsked, TurnSpec, ended_by, prepare, renderer_for, text_of


async def start_turn(service: EngineService, conversation: AgentConversation, body: MessageBody) -> AsyncTurn:
    """Render history + message and submit; raises (400, 503...) before anything is generated."""
    identity = AgentIdentity(conversation.agent_id, AgentSource.API, conversation.display_name or conversation.agent_id)
    spec = TurnSpec(
        conversation.with_user_message(body.content),
        identity,
        body.max_tokens or service.settings.default_max_tokens,
        SamplingAsked(temperature=body.temperature),
        stops_of(body.stop),
        prompt_tokens=await context_prompt(service, conversation, body.content),
        output_format=openai_response_format(body.response_format),
    )
    return service.start_turn(await prepare(service, spec))


async def context_prompt(service: EngineService, conversation: AgentConversation, text: str) -> tuple[int, ...] | None:
    """The prompt of a conversation that continues another client's context (a fork): those
    tokens, then its own messages and ``text`` as the template continues a conversation; None
    for an ordinary conversation (rendered whole by ``prepare``)."""
    if conversation.context_tokens is None:
        return None
    messages = (*conversation.messages, ChatMessage("user", text))
    tail = await service.in_thread(renderer_for(service).continuation, messages)
    return (*conversation.context_tokens, *tail)


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "reused_tokens": usage.reused_tokens,
        "prefilled_tokens": usage.prefilled_tokens,
        "generated_tokens": usage.generated_tokens,
        "ttft_s": usage.ttft_s,
        "decode_tok_s": usage.decode_tok_s,
    }


def sse_event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


@dataclass(slots=True)
class StatefulTurn:
    store: ConversationStore
    agent_id: str
    user_text: str
    turn: AsyncTurn
    # Called exactly once with the finish (None when the client went away first).
    on_end: Callable[[FinishEvent | None], None]
    text: str = ""
    _settled: bool = field(default=False)

    def result(self, finish: FinishEvent) -> dict[str, Any]:
        return {"agent_id": self.agent_id, "content": self.text,
                "finish_reason": ended_by(finish, False), "usage": usage_body(finish.usage)}

    async def settle(self) -> None:
        """Record the exchange (normal finishes only), free the agent for its next turn; once.

        The record is a file write with fsync: it runs on a worker thread, never the event loop.
        """
        if self._settled:
            return
        self._settled = True
        self.turn.cancel()  # a no-op after the finish; stops work for a client that left
        finish = self.turn.finish
        try:
            if finish is not None and not failed(finish):
                await self.store.arecord_turn(self.agent_id, self.user_text, self.text)
        finally:
            self.store.release(self.agent_id)
            self.on_end(finish)

    async def complete(self, disconnected: Callable[[], Awaitable[bool]]) -> dict[str, Any]:
        try:
            events = await self.turn.run_to_finish(disconnected)
            self.text = "".join(text_of(e) for e in events)
        finally:
            await self.settle()
        finish = self.turn.finish
        assert finish is not None
        if failed(finish):
            raise finish_error(finish)
        return self.result(finish)

    async def sse(self, seen: list[EngineEvent], ping_s: float) -> AsyncIterator[str]:
        try:
            async for event in replay(seen, self.turn, ping_s):
                if event is None:
                    yield KEEP_ALIVE
                elif isinstance(event, TokenEvent) and event.text:
                    self.text += event.text
                    yield sse_event("token", {"text": event.text})
                elif isinstance(event, FinishEvent):
                    yield await self._closing(event)
        finally:
            await self.settle()

    async def _closing(self, finish: FinishEvent) -> str:
        # Settled before ``done`` goes out, so a client that sends its next
        # message the moment it reads ``done`` finds the history saved.
        try:
            await self.settle()
        except SemanticError as exc:
            return sse_event("error", stream_error_payload(from_domain(exc)))
        if failed(finish):
            return sse_event("error", stream_error_payload(finish_error(finish)))
        return sse_event("done", self.result(finish))


def busy_error(agent_id: str) -> ApiError:
    return ApiError(409, f"agent {agent_id!r} is already running a turn; send the next message after it finishes")
