"""One stateful turn of the direct agent API: the stored history plus a new
user message in, the reply out, the history extended only when the turn
finished normally (stop, stop sequence or length; never after an error or a
cancellation, so a failed turn can simply be retried).

Streaming uses named SSE events: ``token`` (``{"text": ...}``) per delta of
the answer, ``reasoning`` (``{"text": ...}``) per delta of a thinking model's
reasoning, then ``done`` with the same object a non-streaming call returns
(``reasoning`` in it too), or ``error`` with the app's error shape for
``/v1/agents``. The stored history keeps each reply's reasoning, which the
chat template renders or not as it does for any client.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Awaitable, Callable

from engine.errors import InvalidRequestError, SemanticError
from engine.domain.requests import AgentSource, EngineEvent, FinishEvent, TokenEvent, Usage

from .admission import KEEP_ALIVE, failed, finish_error, replay
from .agents_schemas import MessageBody
from .async_turn import AsyncTurn
from engine.store.conversations import AgentConversation, ConversationStore
from .errors import ApiError, from_domain, stream_error_payload
from .identity import AgentIdentity
from .image_inputs import from_url, image_text
from .openai_translate import stops_of
from .output_formats import openai_response_format
from .reasoning_ask import from_effort
from .service import EngineService
from engine.runtime.engine_thread.engine import Engine
from engine.domain.chat import ChatMessage
from .request_priority import asked_priority
from engine.domain.priority import AgentClass
from .turns import SamplingAsked, TurnSpec, ended_by, prepare, renderer_for, text_of


async def start_turn(service: EngineService, conversation: AgentConversation, body: MessageBody,
                     user: ChatMessage | None = None) -> AsyncTurn:
    """Render history + message (``user``: the body's, read once by the caller) and submit; raises (400, 503...)
    before anything is generated."""
    identity = AgentIdentity(conversation.agent_id, AgentSource.API, conversation.display_name or conversation.agent_id,
                             agent_class=AgentClass(body.agent_class or AgentClass.MAIN.value))
    max_tokens = body.max_tokens or service.settings.default_max_tokens
    reasoning = from_effort(body.reasoning_effort, "reasoning_effort", max_tokens)
    # A fork of another client's context continues in the template of the model the turn is routed to.
    engine = (await service.served(body.model)).engine if conversation.context_tokens is not None else None
    user = user if user is not None else user_message(body)
    if user.parts and conversation.context_tokens is not None:
        raise InvalidRequestError("images: a fork of another client's context takes text messages only", field="images")
    spec = TurnSpec(
        replace(conversation.with_user_message(user), template_kwargs=reasoning.kwargs()),
        identity,
        max_tokens,
        SamplingAsked(temperature=body.temperature),
        stops_of(body.stop),
        prompt_tokens=await context_prompt(service, conversation, body.content, engine),
        output_format=openai_response_format(body.response_format),
        reasoning=reasoning,
        model=body.model,
        priority=asked_priority(body.priority, "priority", {}),
    )
    return service.start_turn(await prepare(service, spec))


def user_message(body: MessageBody) -> ChatMessage:
    """The turn's user message: its images (before the text, as a pasted screenshot comes), then its text."""
    if not body.images:
        return ChatMessage("user", body.content)
    text, parts = image_text([*(from_url(url, f"images.{i}") for i, url in enumerate(body.images)), body.content])
    return ChatMessage("user", text, parts=parts)


async def context_prompt(service: EngineService, conversation: AgentConversation, text: str,
                         engine: Engine | None = None) -> tuple[int, ...] | None:
    """The prompt of a conversation that continues another client's context (a fork): those
    tokens, then its own messages and ``text`` as the template continues a conversation, in the
    template of ``engine``'s model (default: the default model's); None for an ordinary
    conversation (rendered whole by ``prepare``)."""
    if conversation.context_tokens is None:
        return None
    messages = (*conversation.messages, ChatMessage("user", text))
    tail = await service.in_thread(renderer_for(service, engine).continuation, messages)
    return (*conversation.context_tokens, *tail)


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "reused_tokens": usage.reused_tokens,
        "prefilled_tokens": usage.prefilled_tokens,
        "generated_tokens": usage.generated_tokens,
        "reasoning_tokens": usage.reasoning_tokens,
        "ttft_s": usage.ttft_s,
        "decode_tok_s": usage.decode_tok_s,
    }


def sse_event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


@dataclass(slots=True)
class StatefulTurn:
    store: ConversationStore
    agent_id: str
    user: ChatMessage
    turn: AsyncTurn
    # Called exactly once with the finish (None when the client went away first).
    on_end: Callable[[FinishEvent | None], None]
    text: str = ""
    reasoning: str = ""
    _settled: bool = field(default=False)

    def result(self, finish: FinishEvent) -> dict[str, Any]:
        return {"agent_id": self.agent_id, "content": self.text, "reasoning": self.reasoning,
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
                await self.store.arecord_turn(self.agent_id, self.user, self.text, self.reasoning)
        finally:
            self.store.release(self.agent_id)
            self.on_end(finish)

    async def complete(self, disconnected: Callable[[], Awaitable[bool]]) -> dict[str, Any]:
        try:
            events = await self.turn.run_to_finish(disconnected)
            self.text = "".join(text_of(e) for e in events)
            self.reasoning = "".join(e.reasoning for e in events if isinstance(e, TokenEvent))
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
                elif isinstance(event, TokenEvent):
                    if event.reasoning:
                        self.reasoning += event.reasoning
                        yield sse_event("reasoning", {"text": event.reasoning})
                    if event.text:
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
