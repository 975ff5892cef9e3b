"""Every tunable of semantic in one frozen object, and the sections of it each part of the engine takes.

Precedence, highest first: CLI flags (passed as init values) > environment
variables (``SEMANTIC_*``) > ``.env`` > TOML config file > defaults. The TOML
file is ``--config PATH``, else ``$SEMANTIC_CONFIG``, else
``<user config dir>/semantic/config.toml`` when it exists.

A setting keeps its name from the flag to the code that uses it: the engine
takes :class:`EngineSettings`, whose sections (:class:`CacheSettings`,
:class:`BatchSettings`, :class:`TurnSettings`, :class:`SamplingSettings`) hold
the same fields under the same names, with the same defaults, and are passed
whole to the part that uses them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import platformdirs
from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from engine.domain.priority import PriorityPolicy, class_levels_from

APP_NAME = "semantic"
DEFAULT_MODEL = "smollm2-135m"


def default_config_file() -> Path:
    return Path(platformdirs.user_config_dir(APP_NAME)) / "config.toml"


def default_cache_dir() -> Path:
    return Path(platformdirs.user_cache_dir(APP_NAME))


class Settings(BaseSettings):
    """Configuration of one semantic process. Field docs double as ``--help`` text."""

    model_config = SettingsConfigDict(
        env_prefix="SEMANTIC_",
        env_file=".env",
        extra="ignore",
        frozen=True,
    )

    config_file: Path | None = Field(None, description="TOML file with settings (lowest precedence above defaults).")

    # -- model -------------------------------------------------------------
    model: str = Field(
        DEFAULT_MODEL,
        description="Model to load: a registry alias (smollm2-135m, gemma3-270m), an MLX model folder, a .gguf file or a hub id.",
    )
    extra_models: tuple[str, ...] = Field(
        (),
        description="More models to keep resident beside --model, each served to the requests that name it "
                    "(repeat the flag; TOML: extra_models = [...]). Each is ALIAS=SOURCE[,OPTION...]: SOURCE takes "
                    "--model's forms; options: pinned (loaded at start, never unloaded), side (Claude Code's haiku "
                    "tier and its side requests go to it), idle=SECONDS (unloaded after that long unused), pool=MiB "
                    "(its KV pool; default --pool-budget-mb). e.g. --extra-model small=smollm2-135m,side,pinned. "
                    "Weights and KV pools of every resident model count against --models-budget-mb; the least "
                    "recently used unpinned model without a running turn is unloaded (its agents to the warm "
                    "tier) when another needs the room.",
    )
    models_budget_mb: float | None = Field(
        None, gt=0,
        description="Memory the resident models may hold together (each one's weights plus its KV pool budget), "
                    "in MiB. A model that does not fit after unloading what may go is refused with what is resident "
                    "and how much each holds. Default: the machine's memory less 15 percent of it.",
    )
    model_routes: tuple[str, ...] = Field(
        (),
        description="Which model serves a request by its model field, as PATTERN=ALIAS (shell-style, case "
                    "insensitive; first match wins; repeat the flag), after exact names (an alias, a folder name, "
                    "a model id). e.g. --model-route 'gpt-5*=coder'. Built in after these: *haiku* to the side "
                    "model when one is set; every other name (claude-*, unknown ones) to --model.",
    )
    cache_dir: Path = Field(default_factory=default_cache_dir, description="Root for imported models and the warm cache tier.")
    weights_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="dtype of imported GGUF weights; auto = float32 on CPU, bfloat16 on GPU backends."
    )
    trust_remote_code: bool = Field(False, description="Allow hub models with custom tokenizer code.")

    # -- block pool ----------------------------------------------------------
    block_tokens: int = Field(256, ge=16, le=4096, description="Tokens per KV block.")
    pool_budget_mb: float = Field(1024.0, gt=0, description="Memory budget of the KV block pool in MiB.")
    snapshot_budget_mb: float = Field(
        64.0, ge=0,
        description="Models with recurrent layers (Qwen3.5, Qwen3-Next, Nemotron-H, Mamba, RWKV...): MiB per agent "
                    "for snapshots of its recurrent state, kept where a later turn can resume (the start and the "
                    "prompt end of its recent turns; a state cannot be cut back). The oldest go first; at least "
                    "one is always kept; a pool that needs room drops them before evicting agents. 64 MiB keeps 3 of "
                    "Qwen3.5-0.8B's (18.6 MiB each), 1 of Qwen3-Next's (73.7 MiB); up to two more sit at "
                    "shared-prefix points.")

    # -- batching ---------------------------------------------------------------
    max_batch_size: int = Field(16, ge=1, le=512, description="Most sequences decoded together.")
    batch_window_ms: float = Field(10.0, ge=0, le=1000, description="An idle engine waits this long for more requests to prefill together.")
    prefill_step_size: int = Field(512, ge=16, description="Prompt tokens processed per prefill chunk (bounds memory; progress is reported per chunk).")
    speculate: Literal["off", "lookup", "draft"] = Field(
        "lookup",
        description="Speculative decoding inside the batch. lookup: each agent drafts its next tokens by finding "
                    "its latest tokens earlier in its own history (prompt lookup: a file copied with an edit, a "
                    "tool call quoting what it read) and the model verifies every agent's drafts in one pass; "
                    "outputs are unchanged (greedy: token for token; sampled: the same distribution). draft: the "
                    "drafts come from --draft-model instead (the default when one is named). off: one token per "
                    "agent per step.")
    draft_model: str | None = Field(
        None,
        description="A small model with the served model's tokenizer that drafts each agent's next tokens for "
                    "--speculate draft (same forms as --model: alias, folder, .gguf, hub id). Refused at load, with "
                    "the reason, when its tokenizer numbers tokens differently or a layer of it is not full "
                    "attention. It keeps each agent's cache of its own between turns, outside the pool budget, "
                    "for at most --max-batch-size idle agents; not available with ranks (mlx.launch).")
    speculate_max_draft: int = Field(
        7, ge=1, le=64,
        description="The most tokens an agent drafts in one step. Each step verifies the drafts most likely to be "
                    "kept while they raise tokens per second (what a token more in a pass costs on this device, "
                    "each agent's recent acceptance), so an agent copying a file drafts long and eight agents "
                    "writing prose draft little. 7: on the CPU, returning a ~1K-token file with one rename "
                    "decoded faster with 7 than with 15 (66.6 against 61.7 tok/s at 1 agent, 45.4 against 36.5 "
                    "at 8; one run, 2026-11-30).")
    fast_cpu_math: bool = Field(True, description="On the CPU, compute attention's softmax, SiLU and GELU (Gemma) with an exp built from MLX's fast arithmetic (within 2 ulp of mx.exp, about 5x faster per element; GELU about 10x), a long prefill chunk's softmax in compiled rows across the cores (numba; about 15x MLX's), a gated-delta hybrid's prefill recurrence (Qwen3.5, Qwen3-Next) in one compiled loop per head, a hybrid's short depthwise convolution over a prefill chunk in one compiled loop (MLX's sums to the bit), a decode batch's attention in compiled loops over each agent's cache that also write the step's keys and values in place (numba), a speculative step's attention with each agent's tokens together (BLAS on the calling thread), decode's linear layers in one compiled pass over the weights (up to 8 rows inside MLX's forward, 64 in a step run on the host), a Llama-family model's whole decode step on the host (numpy and those loops, no MLX evaluation inside the model), and sampling's top-k pass over the vocabulary in numpy. Off: MLX's own kernels, as mlx_lm runs them.")
    default_max_tokens: int = Field(1024, ge=1, description="Tokens generated when a request names no limit.")
    stored_responses_kept: int = Field(
        1000, ge=1,
        description="Responses API: most stored responses (store: true) kept on disk for previous_response_id and "
                    "GET /v1/responses/{id}; the oldest are deleted past it.",
    )
    max_output_tokens: int = Field(
        4096, ge=1,
        description="Most tokens one response may generate; a request asking for more is clamped, and the clamp "
                    "is logged and reported in the response (Claude Code asks for 32,000 or more).",
    )
    max_output_seconds: float = Field(
        300.0, ge=0,
        description="Most seconds one response may spend generating after its first token; a response still going "
                    "then ends as if it had reached max_tokens, and the log and the agent's last finish say why. "
                    "Otherwise the client may give up first: Claude Code abandons a request after 10 minutes by "
                    "default (API_TIMEOUT_MS) and sends it again, and a small model on a CPU can take longer than "
                    "that to write max_output_tokens. 0 turns it off.",
    )
    repetition_window: int = Field(
        512, ge=0,
        description="End a runaway loop: a response whose last half-window of tokens repeats one cycle of up "
                    "to 128 tokens exactly, or whose last window repeats one with small changes (nine in ten of its tokens "
                    "equal to the token a cycle back, e.g. a numbered list of one sentence); 0 turns it off.",
    )
    close_constrained_loops: bool = Field(
        True,
        description="A reply held to a JSON schema or a strict tool's arguments that loops (an array repeating its "
                    "items, a string repeating itself, or what the repetition guard finds) is steered to the "
                    "shortest end its schema allows, so it parses and validates, instead of running to max_tokens "
                    "or being cut, and so is one about to run to max_tokens unclosed; the response says where "
                    "(usage.semantic.loop_closed). Off: such a reply runs on, and the repetition guard or "
                    "max_tokens cuts it as a truncated reply.",
    )
    default_temperature: float | None = Field(
        None, ge=0, le=2,
        description="Temperature for requests that name none; default: the model folder's "
                    "generation_config.json, else a packaged model's card (SmolLM2: 0.2), else 0.7.",
    )
    default_top_p: float | None = Field(
        None, gt=0, le=1, description="top_p for requests that name none; default: generation_config.json, else a packaged "
                                         "model's card (SmolLM2: 0.9), else 0.95."
    )
    default_top_k: int | None = Field(
        None, ge=0, description="top_k for requests that name none (0: off); default: generation_config.json, else a "
                                         "packaged model's card (SmolLM2: off), else 40."
    )
    max_context_tokens: int | None = Field(None, ge=16, description="Override the model's context length.")

    # -- scheduling: who goes first (docs/scheduling.md) ---------------------------
    priorities: bool = Field(
        True, description="Serve turns by their agent's priority (class defaults below, a request's priority, "
                          "the operator's setting); off: first come, first served.")
    class_priorities: tuple[str, ...] = Field(
        (), description="A class's default level as CLASS=LEVEL (0 most urgent .. 9; repeat the flag). Defaults: "
                        "interactive=0 main=1 side=2 subagent=3 background=6.")
    priority_aging_s: float = Field(
        10.0, gt=0, description="Seconds of head start one priority level is worth: a less urgent turn is "
                                "overtaken only by turns arriving within (its level x this) after it.")
    decode_gap_ms: float | None = Field(
        None, ge=0, le=60_000,
        description="Prefill in chunks that keep a step about this many ms long, so decoding agents' tokens come "
                    "at most that far apart and an arriving turn waits one short step (0: whole prefill chunks). "
                    "Default: six decode steps, 150-750 ms.")
    open_priority_limit: int = Field(
        1, ge=0, le=9,
        description="On a server without --api-key, the most urgent level a request can reach by its priority "
                    "field, header or class hint (1: no client outranks a main agent; the workbench's own chats "
                    "and the operator's settings are not limited; 0: no limit).")
    tool_loop_hold_s: float = Field(
        60.0, ge=0, description="An agent whose reply was a tool call keeps its cache hot this many seconds "
                                "(the client runs the tool and comes back) while other idle caches can go first.")

    # -- cache store (disk tier) ------------------------------------------------
    disk_budget_mb: float = Field(4096.0, gt=0, description="Byte budget of the warm (disk) tier in MiB; past it the oldest warm entries go cold.")
    prefix_sharing: bool = Field(True, description="Let a new agent start from another agent's cached prefix (found per block, shared up to the first differing token).")
    persist_on_exit: bool = Field(True, description="Write every hot agent to the warm tier on clean shutdown.")
    kv_bits_at_rest: Literal["none", "8", "4"] = Field(
        "none",
        description="Quantize idle agents' KV to 8 or 4 bits when the pool needs room: kept in memory first "
                    "(the cool tier, about 3.6x / 6.4x fewer bytes than float32, back by a dequantize), then "
                    "written to disk that way (warm files and shared prefixes). Restored close to, not exactly "
                    "as, computed (bench/bench_kv_at_rest.py). none: exact, no cool tier. Files of either kind "
                    "load under any setting.",
    )

    # -- memory pressure ----------------------------------------------------------
    memory_soft_limit_mb: float | None = Field(
        None, ge=1, le=1e9,
        description="Memory the whole machine may have in use (total minus available: this process, MLX and "
                    "every other application) before the engine gives way: idle agents are cooled and spilled to "
                    "disk, and new turns are admitted only as far as idle caches make room. Default: the "
                    "machine's memory less 15 percent of it (at least 2 GiB).",
    )
    memory_hard_limit_mb: float | None = Field(
        None, ge=1, le=1e9,
        description="Memory the machine may have in use before new requests are refused with the overload "
                    "error and retry-after (Anthropic 529 overloaded_error, OpenAI 503); running turns finish. "
                    "Default: the machine's memory less 5 percent of it (at least 1 GiB). Both watermarks can be "
                    "changed while the server runs (PUT /v1/admin/memory).",
    )

    # -- HTTP ------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="Address the HTTP API binds.")
    port: int = Field(8642, ge=0, le=65535, description="Port of the HTTP API (0 = any free port).")
    allow_remote: bool = Field(False, description="Required to bind an address other than loopback.")
    api_key: SecretStr | None = Field(None, description="When set, requests must carry it as x-api-key or Bearer token.")
    max_body_mb: float = Field(32.0, gt=0, description="Largest accepted request body in MiB (413 above).")
    ping_interval_s: float = Field(10.0, gt=0, description="Seconds between SSE ping events while a prompt is prefilled.")
    max_image_mb: float = Field(20.0, gt=0, description="Largest image a request may carry, in MiB of encoded bytes (413 above, naming the field).")
    max_images_per_request: int = Field(100, ge=0, description="Most images one request may carry, its history included (400 above).")
    max_image_pixels: int = Field(50_000_000, ge=1, description="Most pixels an image may have, read from its header before any decoding (a decompression bomb is a 400).")
    allow_image_urls: bool = Field(False, description="Fetch images that requests name by http(s) URL (off: such an image is a 400; a local server fetching URLs a client names is a risk).")
    text_model_images: Literal["refuse", "placeholder"] = Field(
        "refuse", description="An image sent to a model without vision: refuse (a 400 that says the model has no vision) "
                              "or placeholder (the model reads a short note in its place).")
    image_feature_cache: int = Field(64, ge=0, description="Images whose vision-tower output is kept, so another agent sending the same image computes no vision tower (0: none).")
    request_timeout_s: float = Field(
        1800.0, gt=0,
        description="Longest a request may wait in the queue for a free slot; after it the request is refused "
                    "(Anthropic 529 overloaded_error, OpenAI 503, with retry-after).",
    )
    max_queued_requests: int = Field(
        256, ge=1, description="Most requests waiting for the engine; beyond it new ones get 429 with retry-after."
    )
    stream_max_clients: int = Field(
        64, ge=1, le=4096,
        description="Most clients of the live stream (GET /v1/stream) at once; beyond it new ones get 429.",
    )
    watchdog_s: float = Field(
        60.0, gt=0,
        description="An engine that completes no step for this long while work is pending is reported stalled "
                    "(/health/ready turns 503, the workbench and /metrics say so).",
    )
    shutdown_grace_s: float = Field(10.0, ge=0, description="Seconds in-flight streams get to finish on shutdown.")
    record_requests: Path | None = Field(
        None, description="Append every generation request clients send (headers without secrets, body, timing) "
                          "to this JSONL file, for bench/replay.py.",
    )
    allow_model_swap_by_request: bool = Field(False, description="Let a request's model field trigger a swap.")
    swap_grace_s: float = Field(10.0, ge=0, description="Seconds running turns get to finish when a model swap starts.")
    swap_wait_s: float = Field(60.0, ge=0, description="Longest a request waits for a model swap before a 503 with retry-after.")
    idle_unload_s: float | None = Field(None, gt=0, description="Unload the model after this many idle seconds; the next request reloads it.")

    # -- several processes, one model (mlx.launch) ----------------------------------
    distributed_backend: Literal["any", "ring", "jaccl", "mpi", "nccl"] = Field(
        "any", description="mx.distributed backend when mlx.launch started this process as one of several ranks "
        "(ignored when it runs alone).")
    rank_timeout_s: float = Field(
        300.0, gt=0, description="Under mlx.launch: a rank whose engine makes no progress this long takes a peer "
        "for dead and exits non-zero (MLX can wait forever on a peer killed mid-transfer).")
    shard_mode: Literal["tensor", "pipeline"] = Field(
        "tensor", description="How a model is split across ranks: tensor (each rank holds a share of every "
        "layer's heads). pipeline (each rank a run of layers) is refused with the reason: mlx-lm pipelines "
        "only model families whose caches the block pool does not hold.")

    # -- platform -----------------------------------------------------------------
    preload_openblas: bool = Field(True, description="On Linux CPU, re-exec once with OpenBLAS preloaded (about 30x faster matmul).")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log verbosity.")
    log_json: bool = Field(False, description="Structured JSON logs (default for --serve when not a terminal).")

    @field_validator("cache_dir", mode="after")
    @classmethod
    def _expand(cls, v: Path) -> Path:
        return v.expanduser()

    @field_validator("class_priorities", mode="after")
    @classmethod
    def _class_levels(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        class_levels_from(v)  # a bad CLASS=LEVEL is refused at start, naming it
        return v

    @model_validator(mode="after")
    def _soft_below_hard(self) -> "Settings":
        soft, hard = self.memory_soft_limit_mb, self.memory_hard_limit_mb
        if soft is not None and hard is not None and soft > hard:
            raise ValueError(f"memory_soft_limit_mb ({soft:g}) must not exceed memory_hard_limit_mb ({hard:g})")
        return self

    @model_validator(mode="before")
    @classmethod
    def _draft_model_asks_for_drafts(cls, data: Any) -> Any:
        # Naming a draft model and no speculation mode asks for its drafts (every source is merged here).
        if isinstance(data, dict) and data.get("draft_model") and data.get("speculate") is None:
            return {**data, "speculate": "draft"}
        return data

    @model_validator(mode="after")
    def _draft_needs_a_model(self) -> "Settings":
        if self.speculate == "draft" and not self.draft_model:
            raise ValueError("speculate is 'draft' but no draft_model is named: pass --draft-model REF "
                             "(SEMANTIC_DRAFT_MODEL), or --speculate lookup")
        return self

    @model_validator(mode="after")
    def _models_parse(self) -> "Settings":
        # A bad --extra-model or --model-route is refused at start, before any model loads.
        from engine.domain.model_slots import ModelRoutes, ModelSlotError, model_slots

        try:
            ModelRoutes.of(model_slots(self.model, self.extra_models), self.model_routes)
        except ModelSlotError as exc:
            raise ValueError(str(exc)) from None
        return self

    @model_validator(mode="after")
    def _remote_needs_opt_in(self) -> "Settings":
        if self.host not in ("127.0.0.1", "localhost", "::1") and not self.allow_remote:
            raise ValueError(
                f"host {self.host!r} is not loopback; pass --allow-remote (SEMANTIC_ALLOW_REMOTE=1) to expose the API"
            )
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        toml_file = _toml_path(getattr(init_settings, "init_kwargs", {}))
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings, dotenv_settings, file_secret_settings]
        if toml_file is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_file))
        return tuple(sources)

    # -- derived -----------------------------------------------------------------
    @property
    def models_dir(self) -> Path:
        return self.cache_dir / "models"

    @property
    def agents_dir(self) -> Path:
        return self.cache_dir / "agents"

    @property
    def pool_budget_bytes(self) -> int:
        return int(self.pool_budget_mb * 1024 * 1024)

    @property
    def kv_bits(self) -> int | None:
        """kv_bits_at_rest as a number of bits; None for full precision."""
        return None if self.kv_bits_at_rest == "none" else int(self.kv_bits_at_rest)

    @property
    def disk_budget_bytes(self) -> int:
        return int(self.disk_budget_mb * 1024 * 1024)

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 1024 * 1024)

    @property
    def max_image_bytes(self) -> int:
        return int(self.max_image_mb * 1024 * 1024)


def _toml_path(init_kwargs: dict[str, Any]) -> Path | None:
    explicit = init_kwargs.get("config_file") or os.environ.get("SEMANTIC_CONFIG") or os.environ.get("SEMANTIC_CONFIG_FILE")
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        return path
    default = default_config_file()
    return default if default.is_file() else None


def _default(name: str) -> Any:
    """A setting's default, from its one definition above."""
    return Settings.model_fields[name].default


@dataclass(frozen=True, slots=True)
class CacheSettings:
    """The pool and the tiers: how much memory the KV cache may hold and where it goes when idle."""

    pool_budget_bytes: int = int(_default("pool_budget_mb") * 2**20)
    prefix_sharing: bool = _default("prefix_sharing")
    persist_on_exit: bool = _default("persist_on_exit")
    kv_bits_at_rest: int | None = None  # the setting's "none" / "8" / "4" as bits (None: full precision)


@dataclass(frozen=True, slots=True)
class BatchSettings:
    """The continuous batch: how many sequences decode together and how prompts are fed."""

    max_batch_size: int = _default("max_batch_size")
    prefill_step_size: int = _default("prefill_step_size")
    batch_window_ms: float = _default("batch_window_ms")
    snapshot_budget_mb: float = _default("snapshot_budget_mb")
    speculate: str = _default("speculate")
    speculate_max_draft: int = _default("speculate_max_draft")
    image_feature_cache: int = _default("image_feature_cache")

    @property
    def max_draft(self) -> int:
        """The most tokens a sequence drafts a step (0: no speculation)."""
        return self.speculate_max_draft if self.speculate in ("lookup", "draft") else 0


@dataclass(frozen=True, slots=True)
class TurnSettings:
    """What one turn may do: how long it may wait and generate, how much it may write, and the context."""

    max_output_tokens: int = _default("max_output_tokens")
    max_output_seconds: float = _default("max_output_seconds")
    repetition_window: int = _default("repetition_window")
    close_constrained_loops: bool = _default("close_constrained_loops")
    max_queued_requests: int = _default("max_queued_requests")
    request_timeout_s: float = _default("request_timeout_s")
    watchdog_s: float = _default("watchdog_s")
    max_context_tokens: int | None = _default("max_context_tokens")


@dataclass(frozen=True, slots=True)
class SchedulingSettings:
    """Who goes first: priorities, aging, the decode gap prefill keeps, tool-loop holds."""

    priorities: bool = _default("priorities")
    class_priorities: tuple[str, ...] = ()
    priority_aging_s: float = _default("priority_aging_s")
    decode_gap_ms: float | None = _default("decode_gap_ms")
    tool_loop_hold_s: float = _default("tool_loop_hold_s")

    def policy(self) -> PriorityPolicy:
        return PriorityPolicy(class_levels_from(self.class_priorities), self.priority_aging_s, self.priorities)


@dataclass(frozen=True, slots=True)
class MemorySettings:
    """The memory watermarks in MiB (None: derived from the machine's memory, engine/platform/memory.py)."""

    memory_soft_limit_mb: float | None = None
    memory_hard_limit_mb: float | None = None


@dataclass(frozen=True, slots=True)
class SamplingSettings:
    """Overrides of the model's sampling defaults for requests that name none (None: the model's)."""

    default_temperature: float | None = None
    default_top_p: float | None = None
    default_top_k: int | None = None


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """Everything the engine takes from the settings, by section."""

    cache: CacheSettings = field(default_factory=CacheSettings)
    batch: BatchSettings = field(default_factory=BatchSettings)
    turns: TurnSettings = field(default_factory=TurnSettings)
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    memory: MemorySettings = field(default_factory=MemorySettings)
    scheduling: SchedulingSettings = field(default_factory=SchedulingSettings)
    fast_cpu_math: bool = _default("fast_cpu_math")

    @classmethod
    def of(cls, settings: Settings) -> "EngineSettings":
        """The sections of ``settings``, each field read under its own name."""
        return cls(
            cache=CacheSettings(settings.pool_budget_bytes, settings.prefix_sharing, settings.persist_on_exit,
                                settings.kv_bits),
            batch=_section(BatchSettings, settings),
            turns=_section(TurnSettings, settings),
            sampling=_section(SamplingSettings, settings),
            memory=_section(MemorySettings, settings),
            scheduling=_section(SchedulingSettings, settings),
            fast_cpu_math=settings.fast_cpu_math,
        )


def _section(section: type, settings: Settings) -> Any:
    return section(**{f.name: getattr(settings, f.name) for f in fields(section)})


def load_settings(**overrides: Any) -> Settings:
    """Build settings with ``overrides`` (e.g. parsed CLI flags) on top; ``None`` values are ignored."""
    return Settings(**{k: v for k, v in overrides.items() if v is not None})
