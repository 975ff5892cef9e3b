"""The compute backend for MLX's CPU device: the host paths that pay there, behind one object.

MLX's CPU backend pays ~5-90 us per operation and evaluation before any
arithmetic, and its ``exp`` costs ~15 ns an element; a decode step is a few
hundred small operations per layer. What this backend does instead (each
measured in its module's docstring):

* attention, softmax, SiLU and GELU from MLX's fast arithmetic
  (``cpu_math.py``), for the engine's caches (``host_kv.py``) and the model's
  MLPs (``hooks.py``);
* a decode batch's attention in compiled loops over each row's cache, which
  also write the step's keys and values in place (``host_decode.py``);
* decode's linear layers at up to 8 rows in one compiled pass over the
  weights (``host_linear.py``);
* a Llama-family model's whole decode step in numpy and those loops
  (``host_forward.py``);
* sampling's top-k pass over the vocabulary in numpy (``host_top_k.py``);
* a gated-delta hybrid's prefill recurrence in one compiled loop per head
  (``host_gated_delta.py``), and a hybrid's short depthwise convolution over
  a prefill chunk in one compiled loop (``host_conv.py``);
* a long prefill chunk's softmax in compiled rows across both cores
  (``host_softmax.py``, chosen per call in ``host_attention.py``);
* a vision tower's attention and GELU the same ways, inside :meth:`vision_pass`.

Everything is decided here, once per engine: no module flag, no thread-local.
The wrappers and layer classes that reach into the model act only inside this
backend's own :meth:`forward` (:meth:`inside_forward`), so mlx-lm's own
generation on the same model object (the tests' references) keeps MLX's
kernels. Benchmarks turn parts off by constructing it with ``CpuOptions``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Sequence

import mlx.core as mx

import engine.runtime.runner.backends.mlx_passes as mlx_passes
from engine.domain.cache_spec import ModelCacheSpec
from engine.runtime.runner.backends.cpu import (
    host_conv,
    host_decode,
    host_forward,
    host_gated_delta,
    host_heads,
    host_linear,
    host_packed_decode,
    host_softmax,
)
from engine.runtime.runner.backends.cpu.hooks import ActivationHooks
from engine.runtime.runner.backends.cpu.host_attention import HOST_ATTENTION
from engine.runtime.runner.backends.cpu.host_kv import (
    HOST_KINDS,
    HOST_KINDS_BESIDE_RECURRENT,
    HostFullKV,
    HostPaddedLayerCache,
    HostRaggedLayerCache,
)
from engine.runtime.runner.backends.cpu.host_top_k import HostTopK
from engine.runtime.runner.backends.protocol import PromptChunk
from engine.runtime.runner.kv.kinds import LayerKinds
from engine.runtime.runner.kv.padded import PaddedLayerCache
from engine.runtime.runner.kv.ragged import RaggedLayerCache
from engine.runtime.runner.kv.sequence_kv import SequenceKV
from engine.runtime.runner.sampling import mlx_top_k

log = logging.getLogger("semantic.engine")
# The most prompt tokens a prefill pass of their own runs whole on the host (``CpuOptions.host_prefill``). A
# warm turn's time to its first token on SmolLM2 (in-process engine, medians of 3, two runs each way, the 2-core
# Sapphire Rapids box), through MLX's forward -> on the host: 8 / 31 / 64 new tokens after 1,100 cached
# 239-248 / 309-312 / 347-374 ms -> 168-178 / 254-281 / 278-291 ms, and with none cached 203-208 / 243-254 /
# 241-249 -> 167-188 / 210-219 / 214-233; from 128 tokens on no faster (256 with none cached: 438-440 -> 510-518).
HOST_PREFILL_MAX_TOKENS = 64
# The load stage (engine/models/gguf_import.py ImportProgress) under which the compiled loops' loading is reported.
COMPILING = "compiling"


@dataclass(frozen=True, slots=True)
class CpuOptions:
    """Which host paths run (all by default; benchmarks turn some off to compare)."""

    activations: bool = True  # SiLU and GELU from cpu_math inside the model's MLPs
    decode_loops: bool = True  # a decode batch's attention (and in-place writes) in compiled loops
    linear_pass: bool = True  # few-row products through linear_kernel
    head_products: bool = True  # latent attention's per-head projections, the batch folded in (host_heads)
    host_step: bool = True  # a Llama-family decode step whole on the host
    host_prefill: bool = True  # and its short prefill passes (``HOST_PREFILL_MAX_TOKENS``)
    host_top_k: bool = True  # sampling's top-k pass in numpy
    recurrence: bool = True  # a gated-delta hybrid's prefill steps in a compiled loop
    depthwise_conv: bool = True  # a hybrid's short convolution over a prefill chunk in a compiled loop
    # A long prefill chunk's softmax in compiled rows. The kernel is one per process: once any CPU backend has
    # loaded it, every CPU backend's caches use it (False here only keeps this one from loading it).
    prefill_softmax: bool = True
    vision_tower: bool = True  # a vision tower's attention (host_attention) and GELU (cpu_math): vision_pass


class CpuBackend:
    """``protocol.Backend`` on MLX's CPU device: the host paths above where they apply, MLX's forward
    (``mlx_passes``) for the rest."""

    name = "cpu"
    kinds: LayerKinds = HOST_KINDS

    def __init__(self, options: CpuOptions = CpuOptions()) -> None:
        self.options = options
        self._ragged_hooks = mlx_passes.RaggedHooks()
        # The compiled loops load in the background (attach); a failure to load turns them off here. Without
        # numba (a Linux dependency only) they are off from the start.
        compiler = importlib.util.find_spec("numba") is not None
        self._loops_ok = options.decode_loops and compiler
        self._linear_ok = options.linear_pass and compiler
        self._recurrence_ok = options.recurrence and compiler
        self._conv_ok = options.depthwise_conv and compiler
        self._softmax_ok = options.prefill_softmax and compiler
        self._forward_thread: int | None = None
        self._blas_step = False  # a step whose products all run in BLAS (_latent_batch)
        self._vision_thread: int | None = None
        self._hooks: dict[int, ActivationHooks] = {}
        self._host_step: dict[int, bool] = {}
        self._tables = host_forward.RopeTables()
        self._warming: list[tuple[str, threading.Thread]] = []  # the compiled loops loading: what, and its thread
        self._top_k = HostTopK()
        workers = host_decode.worker_count() - 1
        self._workers = ThreadPoolExecutor(workers, thread_name_prefix="semantic-attention") if workers else None

    # -- the model -----------------------------------------------------------------------
    def kinds_for(self, spec: ModelCacheSpec) -> LayerKinds:
        """A hybrid's attention layers leave long prefill chunks' attention blocks in the model's graph; other
        models evaluate each block (measured both ways: host_attention.py)."""
        return HOST_KINDS_BESIDE_RECURRENT if spec.recurrent_groups else self.kinds

    def attach(self, model: Any, batchable: bool = True) -> bool:
        key = id(model)
        if key in self._host_step:
            return self._ragged_hooks.attach(model)
        batched = self._ragged_hooks.attach(model, batchable)
        hooks = self._hooks[key] = ActivationHooks(self.inside_forward)
        if self.options.activations:
            hooks.install(model)
        if self._recurrence_ok:
            hooks.install_gated_delta(model, lambda: self._recurrence_ok)
        if self._conv_ok:
            hooks.install_depthwise_conv(model, lambda: self._conv_ok)
        if self.options.vision_tower:
            hooks.install_vision(self.inside_vision_pass, self._tower_attention)
        if self.options.linear_pass:
            host_linear.swap_in(model, self)
        if self.options.head_products:
            host_heads.swap_in(model)
        self._host_step[key] = self.options.host_step and host_forward.supports(model)
        self._warm_up()
        return batched

    def detach(self, model: Any) -> None:
        key = id(model)
        hooks = self._hooks.pop(key, None)
        if hooks is not None:
            hooks.uninstall()
        host_linear.swap_out(model, self)
        host_heads.swap_out(model)
        self._host_step.pop(key, None)
        self._ragged_hooks.detach(model)

    def batched_attention(self, model: Any) -> bool:
        return self._ragged_hooks.attach(model)

    def close(self) -> None:
        """Stop the attention threads (the engine is done)."""
        if self._workers is not None:
            self._workers.shutdown(wait=False)

    def _warm_up(self) -> None:
        """Load (the first time: compile) the compiled loops in the background, so model loading goes on
        meanwhile; where they cannot load, their work stays in MLX and the log says why. The engine waits for
        them before it says ready (:meth:`await_warm_up`)."""
        loads = [(self._loops_ok, host_packed_decode.warm_up, "_loops_ok", "decode attention"),
                 (self._linear_ok, host_linear.warm_up, "_linear_ok", "decode's linear layers"),
                 (self._recurrence_ok, host_gated_delta.warm_up, "_recurrence_ok", "the gated-delta prefill steps"),
                 (self._conv_ok, host_conv.warm_up, "_conv_ok", "the recurrent layers' prefill convolutions"),
                 (self._softmax_ok and not host_softmax.ROW_SOFTMAX.ready, host_softmax.warm_up, "_softmax_ok",
                  "long prefill chunks' softmax")]
        for wanted, warm_up, flag, what in loads:
            if wanted and what not in {name for name, thread in self._warming if thread.is_alive()}:
                thread = threading.Thread(target=self._load, args=(warm_up, flag, what), daemon=True,
                                          name=f"semantic-{flag.strip('_').removesuffix('_ok')}-warmup")
                self._warming.append((what, thread))
                thread.start()

    def await_warm_up(self, progress: Callable[[str, int, int], None] | None = None) -> None:
        """Join the compiled loops' loading, reported as the stage ``"compiling"`` (loops loaded of all). On a
        fresh install numba compiles them here (~8 s on the 2-core box); a first request that came before
        would wait as long (8.4 s against 0.18 s for the second, bench_first_answer), so the engine says ready only
        after this."""
        waiting = [(what, thread) for what, thread in self._warming if thread.is_alive()]
        self._warming = []
        for done, (what, thread) in enumerate(waiting):
            if progress is not None:
                progress(COMPILING, done, len(waiting))
            if thread.is_alive():
                log.info("waiting for the CPU's compiled loops: %s", what)
            thread.join()
        if progress is not None and waiting:
            progress(COMPILING, len(waiting), len(waiting))

    def _load(self, warm_up: Any, flag: str, what: str) -> None:
        try:
            warm_up()
        except Exception as exc:  # noqa: BLE001 (any failure to load or compile means: not here)
            setattr(self, flag, False)
            log.warning("%s: MLX runs it instead, its compiled loops did not load (%s: %s)", what, type(exc).__name__, exc)

    # -- forward passes ------------------------------------------------------------------
    def inside_forward(self) -> bool:
        """Whether the calling thread is inside this backend's :meth:`forward` (its wrappers act only there)."""
        return self._forward_thread == threading.get_ident()

    def forward(self, model: Any, inputs: mx.array, cache: Any, embeddings: mx.array | None = None) -> mx.array:
        # Graphs are built while the model is called, so marking the call is enough.
        self._forward_thread = threading.get_ident()
        try:
            return mlx_passes.forward(model, inputs, cache, embeddings)
        finally:
            self._forward_thread = None

    @contextlib.contextmanager
    def vision_pass(self) -> Iterator[None]:
        """A vision tower's run: its attention through the host attention (the compiled softmax rows past
        ``cpu_math.MAX_SCORES`` scores) and its GELU through ``cpu_math``. MLX's CPU attention takes 212 ms a
        layer over the bench's SigLIP tower (12 heads over 1024 patches), the host attention 59 ms. A 1280x800
        screenshot through the bench's towers (bench/bench_vision_tower.py, the 2-core x86
        box): Gemma 3's 448-pixel SigLIP 4.11 -> 2.14 s, Qwen3.5's 12-layer ViT-B 2.66 -> 1.50 s, outputs
        equal to 6.7e-7 of their largest value (tests/model/test_vision_real.py checks each family)."""
        self._vision_thread = threading.get_ident()
        try:
            yield
        finally:
            self._vision_thread = None

    def inside_vision_pass(self) -> bool:
        return self._vision_thread == threading.get_ident()

    def _tower_attention(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                         mask: Any) -> mx.array:
        # Outside the pass while it runs: MLX's attention that the host attention itself calls is MLX's.
        thread, self._vision_thread = self._vision_thread, None
        try:
            return HOST_ATTENTION.sdpa(queries, keys, values, scale, mask)
        finally:
            self._vision_thread = thread

    def ragged(self, layers: Sequence[Any]) -> RaggedLayerCache:
        return HostRaggedLayerCache(layers, self.loops_ready, self._workers)

    def padded(self, layers: Sequence[Any]) -> PaddedLayerCache:
        return HostPaddedLayerCache(layers)

    def layer_views(self, rows: Sequence[SequenceKV]) -> list[Any]:
        return mlx_passes.layer_views(rows, self.ragged, self.padded)

    def loops_ready(self) -> bool:
        return self._loops_ok

    def carries_prompts(self, model: Any, rows: Sequence[SequenceKV], chunks: Sequence[tuple[SequenceKV, int]],
                        widths: Sequence[int] | None = None) -> bool:
        """Where a decode step runs whole on the host, prompt chunks ride it: each chunk's tokens are rows of the
        step's linear layers and attend together over their sequence's cache (as a verification's drafts do), so
        the step reads the weights once for both. A prefill pass of its own costs ~150 ms here before its first
        token (SmolLM2, the 2-core x86 box: an in-process engine timing prefill passes of cycled chunk sizes),
        which is most of a paced step.

        With no ``rows`` (a prefill pass of the chunks alone), the same path where the chunks hold at most
        ``HOST_PREFILL_MAX_TOKENS`` tokens together: MLX's forward costs more than its arithmetic there."""
        kvs = [*rows, *(kv for kv, _ in chunks)]
        if not rows and not (self.options.host_prefill and chunks
                             and sum(m for _, m in chunks) <= HOST_PREFILL_MAX_TOKENS):
            return False
        return (self.steps_on_host(model, kvs)
                and _claimable(kvs, [*(widths or [1] * len(rows)), *(m for _, m in chunks)]))

    def decode(self, model: Any, inputs: mx.array, rows: Sequence[SequenceKV],
               chunks: Sequence[PromptChunk] = ()) -> mx.array:
        if chunks:
            flat = mx.concatenate([inputs.astype(mx.uint32), mx.array([t for _, c in chunks for t in c], dtype=mx.uint32)])
            return host_forward.decode(model, flat, [*rows, *(kv for kv, _ in chunks)], self._tables, self._workers,
                                       self._linear_ok, [1] * len(rows) + [len(c) for _, c in chunks], len(chunks))
        if self.steps_on_host(model, rows):
            return host_forward.decode(model, inputs, rows, self._tables, self._workers, self._linear_ok)
        if len(rows) > 1 and rows[0].spec.latent:
            return self._latent_batch(model, inputs, rows)
        return mlx_passes.decode(self, model, inputs, rows)

    def _latent_batch(self, model: Any, inputs: mx.array, rows: Sequence[SequenceKV]) -> mx.array:
        """A latent-attention model's batch step with its layers' products in BLAS: its heads' projections folded
        over the rows (``host_heads``) and the rows' attention in one product a layer (``HostPaddedLayerCache``),
        the linear pass kept out of the layers. The pass and BLAS taking turns in one step is what costs there: at
        8 rows of the DeepSeek V3 shape, 142-147 tok/s with the pass in every layer, 170-176 without (2 repeats),
        and the pass for the layers' larger products only (medians of 4) 112-124 against 219. The output head,
        the step's last product and a third of the weights read, takes the pass (``few_rows``'s ``head``):
        DeepSeek V3 shape at 4 / 8 / 16 rows 136 / 234 / 363 -> 168 / 307 / 376 tok/s, GLM-4.7-Flash shape
        128 / 210 / 318 -> 160 / 240 / 336 (medians of 4). A lone row keeps the pass everywhere.
        (In-process engine, N distinct prompts of 96 tokens each, the variants alternating in one process,
        bench.random_model's folders, the 2-core x86 box.)"""
        self._blas_step = True
        try:
            return mlx_passes.decode(self, model, inputs, rows)
        finally:
            self._blas_step = False

    def verify(self, model: Any, inputs: Sequence[Sequence[int]], rows: Sequence[SequenceKV],
               chunks: Sequence[PromptChunk] = ()) -> tuple[mx.array, bool]:
        """A speculative step whole on the host where a decode step would run there and every row may claim all
        of its positions (each token a row of its own: ``host_forward.decode``'s widths); else through MLX.
        ``chunks`` (where :meth:`carries_prompts` said so) ride it as in :meth:`decode`."""
        widths = [len(tokens) for tokens in inputs]
        if chunks or (self.steps_on_host(model, rows) and _claimable(rows, widths)):
            flat = mx.array([t for tokens in inputs for t in tokens] + [t for _, c in chunks for t in c],
                            dtype=mx.uint32)
            return host_forward.decode(model, flat, [*rows, *(kv for kv, _ in chunks)], self._tables, self._workers,
                                       self._linear_ok, widths + [len(c) for _, c in chunks], len(chunks)), True
        return mlx_passes.verify(self, model, inputs, rows)

    def draft_row_cost(self, model: Any) -> float:
        """On the host path each sequence's own token is a row of the linear layers' products and of
        ``host_decode``'s attention loops, and 2 cores are busy with them: SmolLM2 at 1,000 tokens of context, a
        pass of one token for eight agents takes about 3.3 passes of one for one agent (193 against 58 ms;
        the 2-core CPU box). A drafted token costs less
        (:meth:`draft_token_cost`)."""
        if self._host_step.get(id(model)) and self._loops_ok:
            return 0.3
        return mlx_passes.draft_row_cost()

    def draft_token_cost(self, model: Any) -> float:
        """On the host path a sequence's tokens attend together (``host_verify_attention.py``) and the linear
        layers take up to 64 rows in one read of the weights: SmolLM2 at 1,000 tokens of context, one agent, a
        pass of 1 token 58 ms, of 8 tokens 105 ms (6.7 ms a drafted token); eight agents 193 ms a pass of one
        token each, 262 of two, 354 of four (6-9 ms a drafted token): 0.12-0.15 of a one-token pass
        (the 2-core CPU box)."""
        if self._host_step.get(id(model)) and self._loops_ok:
            return 0.13
        return mlx_passes.draft_row_cost()

    def steps_on_host(self, model: Any, rows: Sequence[Any]) -> bool:
        """Whether a decode step of ``rows`` runs whole on the host (``host_forward.py``): a model whose every
        part it knows, the compiled loops loaded, every row's next position writable in place."""
        return bool(self._host_step.get(id(model))) and self._loops_ok and _claimable(rows)

    def few_rows(self, x: mx.array, weights: mx.array, head: bool = False) -> mx.array | None:
        """A host layer's product through the compiled pass (``host_linear.py``), inside this backend's forward
        passes; None: MLX's matmul. A latent batch's layers keep to BLAS, its output head takes the pass
        (``_latent_batch``)."""
        if not (self._linear_ok and self.inside_forward()) or (self._blas_step and not head):
            return None
        if x.ndim == 3 and x.shape[1] > 1:
            # Several tokens a row (a short prompt chunk, a speculative step's drafts): the pass's evaluation
            # before each product costs more than it saves there (SmolLM2, one agent, 2 to 8 tokens: 180-440 ms
            # a pass with it, 105-170 without; bench_verify_cost, the 2-core CPU box).
            return None
        return host_linear.product(x, weights)

    # -- sampling ------------------------------------------------------------------------
    def top_k_of_logits(self, logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
        if not self.options.host_top_k:
            return mlx_top_k(logits, k)
        return self._top_k(logits, k)

    def describe(self) -> dict[str, object]:
        loaded = {"decode_loops": self._loops_ok, "linear_pass": self._linear_ok, "recurrence": self._recurrence_ok,
                  "depthwise_conv": self._conv_ok, "prefill_softmax": host_softmax.ROW_SOFTMAX.ready}
        return {"compute": self.name, "device": str(mx.default_device()), "host_paths": asdict(self.options) | loaded}


def _claimable(rows: Sequence[Any], widths: Sequence[int] | None = None) -> bool:
    """Every row's next position (``widths[b]`` of them) may be written in place (not after a rewind; full
    attention only)."""
    widths = widths or [1] * len(rows)
    return all(isinstance(layer, HostFullKV) and layer.can_claim(w) for kv, w in zip(rows, widths) for layer in kv.layers)
