"""What both chat protocols share: rendering a conversation into a request,
and turning engine events into text and tool-call pieces."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable

from engine.domain.block_layout import common_prefix_length
from engine.domain.chat import Conversation, ToolCall
from engine.domain.images import PromptImage
from engine.domain.output_format import OutputFormat
from engine.domain.reasoning import CallText
from engine.domain.reasoning_tracker import opened_at
from engine.domain.requests import (
    FinishEvent,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
    next_request_id,
)
from engine.errors import InvalidRequestError
from engine.formats.reasoning_recall import ReasoningRecall
from engine.formats.rendering import PromptRenderer
from engine.formats.tools.calls import (
    BadToolPiece,
    Piece,
    ReasoningPiece,
    TextPiece,
    ToolArgumentsPiece,
    ToolCallStream,
    ToolPiece,
    ToolStartPiece,
    channel_call,
    new_tool_id,
    tool_format_for,
)
from engine.formats.tools.constraints import compile_reply_format, reply_format
from engine.formats.tools.scanning import partial_arguments
from engine.formats.vision_rendering import render_with_images
from engine.models.sampling_defaults import SamplingDefaults
from engine.runtime.engine_thread.engine import Engine

from .agent_lanes import ClientGone
from .async_turn import AsyncTurn
from .identity import AgentIdentity
from .image_inputs import ImageLimits, checked_images
from .reasoning_ask import DEFAULT as DEFAULT_REASONING
from .reasoning_ask import ReasoningAsk
from .request_priority import limited_priority
from .retention import Retention, retained_tokens
from .service import EngineService


@dataclass(frozen=True, slots=True)
class SamplingAsked:
    """What a request said about sampling; what it leaves out comes from the model's defaults
    (engine/models/sampling_defaults.py), one value at a time, as on local servers generally."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None

    def resolve(self, defaults: SamplingDefaults) -> SamplingParams:
        return SamplingParams(
            temperature=defaults.temperature if self.temperature is None else self.temperature,
            top_p=defaults.top_p if self.top_p is None else self.top_p,
            top_k=defaults.top_k if self.top_k is None else self.top_k,
            seed=self.seed,
        )


GREEDY = SamplingAsked(temperature=0.0)


@dataclass(frozen=True, slots=True)
class TurnSpec:
    """A protocol request after translation, before rendering."""

    conversation: Conversation
    identity: AgentIdentity
    max_tokens: int
    sampling: SamplingAsked = SamplingAsked()
    stop: tuple[str, ...] = ()
    # The request's model field: which resident model serves it (model_slots.py); without extra models it
    # swaps models only when allow_model_swap_by_request is on.
    model: str | None = None
    # Anthropic cache_control breakpoints (retention.py).
    retention: Retention | None = None
    # Already rendered (a direct agent forked from another client's context): used as it is.
    prompt_tokens: tuple[int, ...] | None = None
    # Structured outputs (output_formats.py), and the request field that named it (for errors).
    output_format: OutputFormat | None = None
    output_field: str = "response_format"
    # What the request said about a thinking model's reasoning (reasoning_ask.py): its budget, whether it is on.
    reasoning: ReasoningAsk = DEFAULT_REASONING
    # The priority level the request asked for (request_priority.py); None: its agent's or its class's.
    priority: int | None = None
    # Asked by the operator (the embedded workbench's own chats), not by a client over the network: no
    # --open-priority-limit.
    by_operator: bool = False
    # A raw completion (/v1/completions): the prompt as the client wrote it, text (tokenized for the model the
    # turn is routed to) or token ids, continued as it is: no template, no turn ends, no reasoning or tool parsing.
    raw_prompt: str | tuple[int, ...] | None = None


def renderer_for(service: EngineService, engine: Engine | None = None) -> PromptRenderer:
    """A served model's renderer (``EngineService.renderer``: one per model; default: the default model's)."""
    return service.renderer(engine)


async def render_tokens(service: EngineService, conversation: Conversation, engine: Engine | None = None) -> list[int]:
    renderer = renderer_for(service, engine)
    return await service.in_thread(renderer.render, conversation)


async def render_images(service: EngineService, conversation: Conversation,
                        engine: Engine) -> tuple[list[int], tuple[PromptImage, ...]]:
    """A conversation with images: checked (count, bytes, pixels; URLs fetched where allowed), then rendered with
    them for a vision model; for a model without vision, a 400 that says so, or its text with a placeholder for
    each image where the server allows that (text_model_images)."""
    settings = service.settings
    limits = ImageLimits(settings.max_image_bytes, settings.max_images_per_request, settings.max_image_pixels,
                         settings.allow_image_urls)
    conversation = await service.in_thread(checked_images, conversation, limits)
    loaded = engine.loaded
    if loaded.vision is None:
        if settings.text_model_images == "placeholder":
            return await render_tokens(service, conversation, engine), ()
        field = conversation.images[0].field
        raise InvalidRequestError(f"{field}: model {loaded.model_id!r} has no vision ({loaded.vision_note}); send "
                                  "text only, serve a vision model, or start the server with "
                                  "--text-model-images placeholder", field=field)
    rendered = await service.in_thread(render_with_images, renderer_for(service, engine), loaded.vision, conversation)
    return rendered.tokens, rendered.images


async def head_length(service: EngineService, conversation: Conversation, tokens: list[int],
                      engine: Engine | None = None) -> int:
    """How many leading tokens of ``tokens`` the conversation's system prompt and tools account for.

    That is where sessions of one tool part ways, so the engine keeps (and
    stores) the cache at that point for the next session to start from
    (``prefix_hint``), and where cache forensics draw the line between the
    system prompt and the messages.
    """
    head = conversation.head()
    if head is None:
        return 0
    heads = service.rendered_heads(engine)
    key = hashlib.sha256(repr(head).encode("utf-8", "surrogatepass")).hexdigest()
    rendered = heads.get(key)
    if rendered is None:
        rendered = heads.put(key, await service.in_thread(renderer_for(service, engine).render_head, head))
    return common_prefix_length(tokens, rendered)


async def prepare(service: EngineService, spec: TurnSpec, client_gone: ClientGone | None = None) -> GenerationRequest:
    """Render and validate for the model the request is routed to; raises PromptTooLongError and friends before
    any 200 is sent.

    Waits out a model swap or an extra model's load first (or answers 503 after ``swap_wait_s``).
    ``client_gone``: the HTTP request's disconnect check, for a lane whose client went away (agent_lanes.py).
    """
    served = await service.served(spec.model, spec.identity.auxiliary)
    request_id = next_request_id()
    agent_id = spec.identity.agent_id
    if spec.identity.derived:
        agent_id = await service.lanes.claim(served.loaded.identity.key, agent_id, request_id, client_gone)
    try:
        return await _prepared_for(service, served.engine, spec, agent_id, request_id)
    except BaseException:
        service.lanes.release(request_id)
        if service.models is not None:
            service.models.release_lease(served.loaded.identity.key)
        raise


async def _prepared_for(service: EngineService, engine: Engine, spec: TurnSpec, agent_id: str,
                        request_id: str) -> GenerationRequest:
    loaded = engine.loaded
    images: tuple[PromptImage, ...] = ()
    raw = spec.raw_prompt is not None
    if spec.raw_prompt is not None:
        tokens, head = await raw_tokens(service, engine, spec.raw_prompt), 0
    elif spec.prompt_tokens is not None:
        tokens, head = list(spec.prompt_tokens), 0
    else:
        conversation = spec.conversation
        if loaded.reasoning is not None:  # replies sent back without their reasoning get it again
            conversation = service.reasoning_recall.restore(spec.identity.agent_id, conversation)
        if conversation.images:
            tokens, images = await render_images(service, conversation, engine)
        else:
            tokens = await render_tokens(service, conversation, engine)
        head = await head_length(service, conversation, tokens, engine)
    renderer = renderer_for(service, engine)
    tool_format = tool_format_for(loaded.tokenizer, loaded.reasoning)
    output_format = reply_format(spec.conversation, spec.output_format, tool_format,
                                 renderer.turn_end_strings + spec.stop)
    if output_format is not None:  # compiled here, in a worker thread: a bad schema is a 400 before any 200
        await service.in_thread(compile_reply_format, engine.grammars, output_format, spec.conversation,
                                spec.output_format, spec.output_field)
    # Short prompts are not worth a stored prefix of their own.
    hint = head if len(tokens) >= 2 * service.settings.block_tokens else 0
    request = GenerationRequest(
        agent_id=agent_id,  # the identity's, or a sibling lane of it (agent_lanes.py)
        request_id=request_id,
        prompt_tokens=tuple(tokens),
        max_tokens=spec.max_tokens,  # clamped once, by the engine (Engine.validate)
        sampling=spec.sampling.resolve(engine.sampling_defaults),
        prefix_hint=hint,
        head_tokens=head,
        retain_s=spec.retention.ttl_s if spec.retention else 0.0,
        retain_tokens=retained_tokens(spec.retention, len(tokens), head),
        stop_strings=spec.stop,
        turn_end_strings=() if raw else renderer.turn_end_strings,
        source=spec.identity.source,
        display_name=(spec.identity.display_name if agent_id == spec.identity.agent_id
                      else f"{spec.identity.display_name} (lane {agent_id.rsplit('-', 1)[-1]})"),
        auxiliary=spec.identity.auxiliary,
        model_id=loaded.identity.key,
        output_format=output_format,
        reasoning_budget=spec.reasoning.engine_budget,
        reply_start=0 if raw else opened_at(loaded.reasoning, tokens),
        plain_text=raw,
        images=images,
        agent_class=spec.identity.agent_class,
        lineage=spec.identity.lineage,
        priority=limited_priority(spec.priority, spec.identity.agent_class, spec.by_operator, service.settings),
    )
    request = engine.validate(request)
    if request.asked_max_tokens is not None:
        service.note_output_cap(request)
    return request


async def raw_tokens(service: EngineService, engine: Engine, prompt: str | tuple[int, ...]) -> list[int]:
    """A raw completion's prompt as the routed model reads it: text through its tokenizer (special tokens such
    as a BOS added, as mlx-lm's server does), token ids checked against its vocabulary."""
    tokenizer = engine.loaded.tokenizer
    if isinstance(prompt, str):
        return list(await service.in_thread(tokenizer.encode, prompt))
    size = len(tokenizer)
    bad = next((token for token in prompt if not 0 <= token < size), None)
    if bad is not None:
        raise InvalidRequestError(f"prompt: token id {bad} is not in the model's vocabulary (0-{size - 1})",
                                  field="prompt")
    return list(prompt)


CAP_HEADER = "x-semantic-max-tokens"
MODEL_HEADER = "x-semantic-model"


def cap_headers(request: GenerationRequest) -> dict[str, str]:
    """Which model served the turn (its weights' identity, name@digest), and whether the server's output cap
    clamped the max_tokens the client asked for."""
    headers = {MODEL_HEADER: request.model_id} if request.model_id else {}
    if request.asked_max_tokens is None:
        return headers
    return {**headers, CAP_HEADER: f"{request.max_tokens}; asked={request.asked_max_tokens}; setting=max_output_tokens"}


@dataclass(slots=True)
class OutputAssembler:
    """Engine token events in, reasoning, text and tool-call pieces out. Tool calls are parsed from the answer
    text only (when tools were offered), never from inside reasoning; a call the model wrote on its own channel
    (harmony) is one piece once its channel ends."""

    tools: ToolCallStream | None
    id_prefix: str = "toolu_"
    # Where the whole reply (text, calls, reasoning) is recorded when it ends, and under which agent: a
    # thinking model's reasoning recall (None: nothing recorded).
    recall: ReasoningRecall | None = None
    agent_id: str = ""
    text: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    _channel_call: list[Any] = field(default_factory=list)  # [index, start piece, arguments so far] while open
    # Told when the reply ends in tool calls: the client will run them and come back, so the agent's cache is
    # held hot a while (EngineService.hold_tool_loop). None: nobody to tell.
    on_tool_call: Callable[[], None] | None = None

    @classmethod
    def for_turn(cls, service: EngineService, request: GenerationRequest, conversation: Conversation,
                 id_prefix: str, agent_id: str | None = None) -> "OutputAssembler":
        """For the model ``request`` was prepared for. ``agent_id``: whose reply this is, to recall its
        reasoning when a client sends it back without it."""
        engine = service.engine_for(request)
        loaded = engine.loaded
        recall = service.reasoning_recall if agent_id is not None and loaded.reasoning is not None else None
        if not conversation.tools or conversation.tool_choice == "none":
            return cls(None, id_prefix, recall, agent_id or "")
        schemas = [{"type": "function", "function": {"name": t.name, "parameters": t.parameters}} for t in conversation.tools]
        tool_format = tool_format_for(loaded.tokenizer, loaded.reasoning)
        return cls(ToolCallStream(tool_format, schemas, id_prefix), id_prefix, recall, agent_id or "",
                   on_tool_call=lambda: service.hold_tool_loop(engine, request.agent_id))

    def feed(self, event: Any) -> list[Piece]:
        if not isinstance(event, TokenEvent):
            return []
        pieces: list[Piece] = []
        if event.reasoning:
            pieces += self._close_channel_call() + [ReasoningPiece(event.reasoning)]
        for call in event.calls:
            pieces += self._channel_text(call)
        if event.text:
            pieces += self._close_channel_call()
            pieces += self.tools.feed(event.text) if self.tools else [TextPiece(event.text)]
        return self._note(pieces)

    def finish(self) -> list[Piece]:
        pieces = self._note(self._close_channel_call() + (self.tools.finish() if self.tools else []))
        if self.recall is not None:
            self.recall.remember(self.agent_id, self.text, self.calls, self.reasoning)
        if self.calls and self.on_tool_call is not None:
            self.on_tool_call()
        return pieces

    def _channel_text(self, call: CallText) -> list[Piece]:
        open_call = self._channel_call
        pieces: list[Piece] = []
        if not open_call or open_call[0] != call.index:
            pieces += self._close_channel_call()
            start = ToolStartPiece(new_tool_id(self.id_prefix), call.name)
            self._channel_call = open_call = [call.index, start, ""]
            pieces.append(start)
        open_call[2] += call.text
        return pieces + ([ToolArgumentsPiece(open_call[1].id, call.text)] if call.text else [])

    def _close_channel_call(self) -> list[Piece]:
        if not self._channel_call:
            return []
        _, start, arguments = self._channel_call
        self._channel_call = []
        piece = channel_call(start.name, arguments, self.id_prefix)
        # The client saw the call begin: it stays one, under its id (arguments that do not parse: what they hold,
        # and no call to run).
        if isinstance(piece, ToolPiece):
            return [ToolPiece(ToolCall(start.id, start.name, piece.call.arguments), arguments)]
        return [ToolPiece(ToolCall(start.id, start.name, partial_arguments(arguments)), arguments, complete=False)]

    def _note(self, pieces: list[Piece]) -> list[Piece]:
        out: list[Piece] = []
        for piece in pieces:
            if isinstance(piece, BadToolPiece):
                piece = TextPiece(piece.text)
            if isinstance(piece, TextPiece):
                if not piece.text:
                    continue
                self.text += piece.text
            elif isinstance(piece, ReasoningPiece):
                self.reasoning += piece.text
            elif isinstance(piece, ToolPiece) and piece.complete:
                self.calls.append(piece.call)
            out.append(piece)
        return out


def text_of(event: Any) -> str:
    return event.text if isinstance(event, TokenEvent) else ""


def ended_by(finish: FinishEvent, made_tool_calls: bool) -> str:
    """A protocol-neutral ending: stop, tool_use, stop_sequence, length, error, cancelled."""
    outcome = finish.reason.outcome
    return "tool_use" if made_tool_calls and outcome not in ("error", "cancelled") else outcome


__all__ = [
    "AsyncTurn",
    "CAP_HEADER",
    "MODEL_HEADER",
    "cap_headers",
    "GREEDY",
    "OutputAssembler",
    "SamplingAsked",
    "TurnSpec",
    "ended_by",
    "prepare",
    "render_tokens",
    "renderer_for",
    "text_of",
]
