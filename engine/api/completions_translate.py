"""OpenAI text completions to the protocol-neutral turn, and results back.

A raw prompt is continued as it is: no chat template, no turn ends of a
plain transcript, no reasoning or tool-call parsing (``TurnSpec.raw_prompt``).
The text is tokenized as mlx-lm's server tokenizes it (the tokenizer's special
tokens, such as a BOS, added), so both servers continue the same tokens.
Sampling fields absent take the model's defaults, as on chat completions.
"""

from __future__ import annotations

from typing import Any, Mapping

from engine.domain.chat import Conversation
from engine.domain.requests import FinishEvent
from engine.errors import InvalidRequestError
from engine.settings import Settings

from .completions_schemas import CompletionRequest
from .identity import completions_identity, with_client_hints
from .openai_translate import CompletionMeta, finish_reason, stops_of, usage_body
from .request_priority import asked_priority
from .turns import SamplingAsked, TurnSpec

OBJECT = "text_completion"


def to_turn_spec(body: CompletionRequest, headers: Mapping[str, str], settings: Settings) -> TurnSpec:
    identity = with_client_hints(completions_identity(headers, body.session_id), headers)
    sampling = SamplingAsked(temperature=body.temperature, top_p=body.top_p,
                             seed=body.seed % 2**64 if body.seed is not None else None)
    return TurnSpec(Conversation(()), identity, body.max_tokens or settings.default_max_tokens, sampling,
                    stops_of(body.stop), model=body.model, raw_prompt=raw_prompt(body.prompt),
                    priority=asked_priority(body.priority, "priority", headers))


def raw_prompt(prompt: str | list[str] | list[int] | list[list[int]]) -> str | tuple[int, ...]:
    """The one prompt of a request: text, or token ids (a list holding one of either is taken as it)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise InvalidRequestError(f"prompt: one prompt per request, got a list of {len(prompt)} (send one "
                                      "request each)", field="prompt")
        prompt = prompt[0]
    if not prompt:
        raise InvalidRequestError("prompt must not be empty", field="prompt")
    return prompt if isinstance(prompt, str) else tuple(prompt)  # type: ignore[arg-type]


def completion_body(meta: CompletionMeta, text: str, finish: FinishEvent) -> dict[str, Any]:
    return {
        "id": meta.id,
        "object": OBJECT,
        "created": meta.created,
        "model": meta.model,
        "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason(finish, [])}],
        "usage": usage_body(finish.usage),
        "agent_id": meta.agent_id,
    }


def chunk_body(meta: CompletionMeta, text: str, finish: FinishEvent | None = None) -> dict[str, Any]:
    """One streamed chunk: a piece of the text, or (``finish``) the chunk that says why it ended."""
    choice = {"text": text, "index": 0, "logprobs": None,
              "finish_reason": finish_reason(finish, []) if finish is not None else None}
    return {"id": meta.id, "object": OBJECT, "created": meta.created, "model": meta.model, "choices": [choice]}


def usage_chunk_body(meta: CompletionMeta, finish: FinishEvent) -> dict[str, Any]:
    """With ``stream_options.include_usage``: the last chunk before ``[DONE]``, no choices and the usage."""
    return {"id": meta.id, "object": OBJECT, "created": meta.created, "model": meta.model, "choices": [],
            "usage": usage_body(finish.usage)}
