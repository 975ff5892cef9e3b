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

    config_file: Path | None = Field(
        None,
        description="TOML file of settings, read below flags, environment and .env; unset: <user config "
                    "dir>/semantic/config.toml when it exists.")

    # -- model -------------------------------------------------------------
    model: str = Field(
        DEFAULT_MODEL,
        description="Model to serve: a packaged alias (smollm2-135m, gemma3-270m), an MLX model folder, a .gguf file "
                    "or a hub id.",
    )
    extra_models: tuple[str, ...] = Field(
        (),
        description="More models kept resident beside --model, each serving the requests that name it, as "
                    "ALIAS=SOURCE[,pinned][,side][,idle=SECONDS][,pool=MiB] (repeat the flag); e.g. "
                    "small=smollm2-135m,side.",
    )
    models_budget_mb: float | None = Field(
        None, gt=0,
        description="MiB the resident models' weights and KV pools may hold together; past it the least recently "
                    "used idle unpinned model is unloaded. Unset: the machine's memory less 15 percent of it.",
    )
    model_routes: tuple[str, ...] = Field(
        (),
        description="Which resident model serves a request's model field, as PATTERN=ALIAS (shell-style, "
                    "case-insensitive, first match wins; repeat the flag); names no route matches go to --model.",
    )
    cache_dir: Path = Field(
        default_factory=default_cache_dir,
        description="Root for imported models, agents' caches on disk and stored conversations.")
    weights_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="dtype of imported GGUF weights; auto: float32 on the CPU, bfloat16 on GPU backends."
    )
    trust_remote_code: bool = Field(False, description="Allow hub models whose tokenizer runs custom code.")

    # -- block pool ----------------------------------------------------------
    block_tokens: int = Field(
        256, ge=16, le=4096,
        description="Tokens per KV block: the unit the pool allocates and agents share prefixes in.")
    pool_budget_mb: float = Field(
        1024.0, gt=0,
        description="Memory of the KV block pool in MiB; past it idle agents are evicted to the slower tiers, least "
                    "recently used first.")
    snapshot_budget_mb: float = Field(
        64.0, ge=0,
        description="Models with recurrent layers (Qwen3.5, Mamba, ...): MiB per agent of snapshots of its recurrent "
                    "state where a later turn can resume; the oldest go first, one is always kept.")

    # -- batching ---------------------------------------------------------------
    max_batch_size: int = Field(16, ge=1, le=512, description="Most sequences decoded together in one step.")
    batch_window_ms: float = Field(
        10.0, ge=0, le=1000,
        description="An idle engine waits this long for more requests to prefill together, while requests have "
                    "been arriving together; a lone request is stepped at once.")
    prefill_step_size: int = Field(
        512, ge=16,
        description="Most prompt tokens in one prefill chunk (bounds memory; progress is reported per chunk); while "
                    "agents decode, chunks are paced shorter (--decode-gap-ms).")
    speculate: Literal["off", "lookup", "draft"] = Field(
        "lookup",
        description="Speculative decoding in the batch: lookup (each agent drafts from its own history), draft "
                    "(--draft-model drafts; the default when one is named) or off. Outputs are unchanged either way.")
    draft_model: str | None = Field(
        None,
        description="A small model with the served model's tokenizer that drafts every agent's next tokens for "
                    "--speculate draft (the forms of --model); refused at load, with the reason, where it does not "
                    "fit.")
    speculate_max_draft: int = Field(
        7, ge=1, le=64,
        description="The most tokens an agent drafts in one step; each step drafts only as many as are likely to "
                    "raise tokens per second.")
    fast_cpu_math: bool = Field(
        True,
        description="On MLX's CPU device, run the CPU compute backend: a faster exp, compiled loops (numba) and BLAS "
                    "paths for attention, linear layers, recurrences and sampling. Off: MLX's own kernels, as mlx_lm "
                    "runs them.")
    default_max_tokens: int = Field(1024, ge=1, description="Tokens generated when a request names no limit.")
    stored_responses_kept: int = Field(
        1000, ge=1,
        description="Responses API: most stored responses (store: true) kept on disk for previous_response_id; the "
                    "oldest are deleted past it.",
    )
    max_output_tokens: int = Field(
        4096, ge=1,
        description="Most tokens one response may generate; a request asking for more is clamped, and the clamp is "
                    "logged and reported in the response.",
    )
    max_output_seconds: float = Field(
        300.0, ge=0,
        description="Most seconds one response may generate after its first token; then it ends as if it had reached "
                    "max_tokens, before its client gives up on it (0: no limit).",
    )
    repetition_window: int = Field(
        512, ge=0,
        description="Tokens the runaway-loop guard watches: a reply repeating one cycle exactly over half of them, "
                    "or nearly (9 tokens in 10) over all, is ended (0: off).",
    )
    close_constrained_loops: bool = Field(
        True,
        description="A reply held to a JSON schema or a strict tool's arguments that loops, or is about to run out "
                    "of tokens unclosed, is steered to the shortest end its schema allows, so it parses. Off: it "
                    "runs on and is cut.",
    )
    default_temperature: float | None = Field(
        None, ge=0, le=2,
        description="Temperature for requests that name none; unset: the model folder's generation_config.json, else "
                    "a packaged model's card, else 0.7.",
    )
    default_top_p: float | None = Field(
        None, gt=0, le=1, description="top_p for requests that name none; unset: generation_config.json, else a "
                                      "packaged model's card, else 0.95."
    )
    default_top_k: int | None = Field(
        None, ge=0, description="top_k for requests that name none (0: off); unset: generation_config.json, else a "
                                "packaged model's card, else 40."
    )
    max_context_tokens: int | None = Field(
        None, ge=16,
        description="Context length in tokens to use instead of the model's own.")

    # -- scheduling: who goes first (docs/scheduling.md) ---------------------------
    priorities: bool = Field(
        True, description="Serve turns by their agent's priority level, then arrival; off: first come, first served.")
    class_priorities: tuple[str, ...] = Field(
        (), description="A class's default level as CLASS=LEVEL (0 most urgent .. 9; repeat the flag). Defaults: "
                        "interactive=0 main=1 side=2 subagent=3 background=6.")
    priority_aging_s: float = Field(
        10.0, gt=0, description="Seconds of head start one priority level is worth: a less urgent turn is overtaken "
                                "only by turns arriving within (its level x this) after it.")
    decode_gap_ms: float | None = Field(
        None, ge=0, le=60_000,
        description="Step length in ms that prefill is paced to while agents decode, so their tokens come about that "
                    "far apart (0: whole prefill chunks). Unset: six decode steps, 150-750 ms.")
    open_priority_limit: int = Field(
        1, ge=0, le=9,
        description="Without --api-key, the most urgent level a request may ask for by its priority field, header or "
                    "class hint (1: none outranks a main agent; 0: no limit).")
    tool_loop_hold_s: float = Field(
        60.0, ge=0, description="Seconds an agent whose reply was a tool call keeps its cache hot while its client "
                                "runs the tool.")

    # -- cache store (disk tier) ------------------------------------------------
    disk_budget_mb: float = Field(
        4096.0, gt=0,
        description="Byte budget of the warm (disk) tier in MiB; past it the oldest warm agents go cold.")
    prefix_sharing: bool = Field(
        True,
        description="Let a new agent start from another agent's cached prefix (hot or on disk), shared up to the "
                    "first differing token.")
    persist_on_exit: bool = Field(
        True,
        description="Write every hot agent to the warm (disk) tier on a clean shutdown.")
    kv_bits: Literal["none", "8", "4"] = Field(
        "none",
        description="Hold the hot pool's full-attention K/V quantized to 8 or 4 bits: 1.9x or 3.6x the tokens at "
                    "bfloat16 (3.5x or 6x at float32), close to, not exactly, full precision. none: exact.",
    )
    kv_group_size: Literal[32, 64, 128] = Field(
        64,
        description="Values of a head that share one scale and bias under --kv-bits (mlx-lm's default: 64).",
    )
    kv_bits_at_rest: Literal["none", "8", "4"] = Field(
        "none",
        description="Quantize idle agents' KV to 8 or 4 bits when the pool needs room, in memory (the cool tier) and "
                    "on disk: close to, not exactly, the computed cache. none: exact, no cool tier.",
    )

    # -- memory pressure ----------------------------------------------------------
    memory_soft_limit_mb: float | None = Field(
        None, ge=1, le=1e9,
        description="MiB the whole machine may have in use before idle agents are spilled to disk and new turns wait "
                    "for room; unset: the machine's memory less 15 percent (at least 2 GiB).",
    )
    memory_hard_limit_mb: float | None = Field(
        None, ge=1, le=1e9,
        description="MiB the whole machine may have in use before new requests are refused as overloaded (Anthropic "
                    "529, OpenAI 503); unset: the machine's memory less 5 percent (at least 1 GiB).",
    )

    # -- HTTP ------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="Address the HTTP API binds.")
    port: int = Field(8642, ge=0, le=65535, description="Port of the HTTP API (0: any free port).")
    allow_remote: bool = Field(False, description="Required to bind an address other than loopback.")
    api_key: SecretStr | None = Field(
        None,
        description="When set, requests must carry it as x-api-key or Bearer token.")
    max_body_mb: float = Field(32.0, gt=0, description="Largest accepted request body in MiB (413 above).")
    ping_interval_s: float = Field(
        10.0, gt=0,
        description="Seconds between SSE ping events while a prompt is prefilled.")
    max_image_mb: float = Field(
        20.0, gt=0,
        description="Largest image a request may carry, in MiB of encoded bytes (413 above, naming the field).")
    max_images_per_request: int = Field(
        100, ge=0,
        description="Most images one request may carry, its history included (400 above).")
    max_image_pixels: int = Field(
        50_000_000, ge=1,
        description="Most pixels an image may have, read from its header before decoding (a decompression bomb is a "
                    "400).")
    allow_image_urls: bool = Field(
        False,
        description="Fetch images that requests name by http(s) URL; off: such an image is a 400.")
    text_model_images: Literal["refuse", "placeholder"] = Field(
        "refuse", description="An image sent to a model without vision: refuse (a 400 that says so) or placeholder "
                              "(the model reads a short note in its place).")
    image_feature_cache: int = Field(
        64, ge=0,
        description="Images whose vision-tower output is kept, so another agent sending the same image skips the "
                    "tower (0: none).")
    request_timeout_s: float = Field(
        1800.0, gt=0,
        description="Seconds a request may wait in the queue for a free slot before it is refused as overloaded "
                    "(Anthropic 529, OpenAI 503, with retry-after).",
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
        description="Seconds without a completed step, while work is pending, after which the engine is reported "
                    "stalled (/health/ready turns 503).",
    )
    shutdown_grace_s: float = Field(10.0, ge=0, description="Seconds in-flight streams get to finish on shutdown.")
    record_requests: Path | None = Field(
        None, description="Append every generation request clients send (headers without secrets, body, timing) to "
                          "this JSONL file, for bench/replay.py.",
    )
    allow_model_swap_by_request: bool = Field(False, description="Let a request's model field trigger a model swap.")
    swap_grace_s: float = Field(
        10.0, ge=0,
        description="Seconds running turns get to finish when a model swap starts.")
    swap_wait_s: float = Field(
        60.0, ge=0,
        description="Longest a request waits for a model swap before a 503 with retry-after.")
    idle_unload_s: float | None = Field(
        None, gt=0,
        description="Unload the model after this many idle seconds; the next request reloads it.")

    # -- several processes, one model (mlx.launch) ----------------------------------
    distributed_backend: Literal["any", "ring", "jaccl", "mpi", "nccl"] = Field(
        "any", description="mx.distributed backend when mlx.launch started this process as one of several ranks "
                           "(ignored when it runs alone).")
    rank_timeout_s: float = Field(
        300.0, gt=0, description="Under mlx.launch: seconds without engine progress after which a rank takes a peer "
                                 "for dead and exits non-zero.")
    shard_mode: Literal["tensor", "pipeline"] = Field(
        "tensor", description="How a model is split across ranks: tensor (each rank holds a share of every layer's "
                              "heads); pipeline is refused, with the reason.")

    # -- platform -----------------------------------------------------------------
    preload_openblas: bool = Field(
        True,
        description="On Linux CPU, re-exec once with OpenBLAS preloaded (about 30x faster matmul).")
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
    def bits_at_rest(self) -> int | None:
        """kv_bits_at_rest as a number of bits; None for full precision."""
        return None if self.kv_bits_at_rest == "none" else int(self.kv_bits_at_rest)

    @property
    def hot_kv_bits(self) -> int | None:
        """kv_bits as a number of bits; None for full precision."""
        return None if self.kv_bits == "none" else int(self.kv_bits)

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
                                settings.bits_at_rest),
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
