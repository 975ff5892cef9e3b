"""Request and response bodies of OpenAI's text completions endpoint (``POST /v1/completions``).

The endpoint base models need: the prompt is text the model continues as it
is, with no chat template. Fields that would change what comes back in a way
this server does not do (``n`` or ``best_of`` above 1, ``logprobs``,
``suffix``) are refused with a 400 naming them rather than ignored, so an
evaluation harness that reads them never gets silently wrong numbers; any
other unknown field is accepted and ignored, as on the chat endpoint.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .openai_schemas import StreamOptions, UsageOut


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    # Any name is accepted: the server answers with the model it has loaded (or the resident one it names).
    model: str | None = None
    # Text, or token ids; a list of one of either is taken too (one prompt per request).
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="The text to continue (or its token ids); one prompt per request.", union_mode="left_to_right")
    max_tokens: int | None = Field(None, ge=1, description="Default: the server's default_max_tokens.")
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: bool = Field(False, description="The prompt's text before the completion in `text`.")
    n: int | None = Field(None, ge=1, le=1, description="Only one choice is generated per request.")
    best_of: int | None = Field(None, ge=1, le=1, description="Only one candidate is generated per request.")
    logprobs: int | None = Field(None, description="Not returned by this server: leave it out.")
    suffix: str | None = Field(None, description="Insertion is not supported: leave it out.")
    # Extension of this server: names the agent whose KV cache the request reuses (as on chat completions).
    session_id: str | None = None
    # The turn's priority level, 0-9 (0 most urgent) or a class name, as vLLM takes it (request_priority.py).
    priority: int | str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: object) -> object:
        # One message for any other shape (pydantic would list a failure per member of the union).
        if isinstance(value, str) or (isinstance(value, list) and (
                all(isinstance(v, str) for v in value) or all(_is_id(v) for v in value)
                or all(isinstance(v, list) and all(_is_id(i) for i in v) for v in value))):
            return value
        raise ValueError("a prompt is a string, a list of token ids, or a list holding one of either")

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: int | None) -> int | None:
        if value is not None:
            raise ValueError("log probabilities are not returned by this server; leave logprobs out")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("insertion (a suffix after the completion) is not supported; leave suffix out")
        return value or None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class CompletionChoiceOut(BaseModel):
    text: str
    index: int
    logprobs: None = None
    finish_reason: Literal["stop", "length"]


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoiceOut]
    usage: UsageOut
    agent_id: str = Field(description="Extension: the agent whose cache served the request.")
