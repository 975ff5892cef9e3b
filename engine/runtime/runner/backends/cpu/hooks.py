"""The CPU backend's SiLU, GELU and gated-delta steps: functions of mlx-lm's and ``mlx.nn``'s namespaces,
wrapped while attached.

Why patch a namespace: mlx-lm's MLPs call ``swiglu`` by the name their module
imported, and Gemma's call ``nn.gelu_approx`` through ``mlx.nn``; they take
arrays only, no cache through which the engine could route them. So the
backend wraps those names when it attaches a model and unwraps them when it
detaches. A wrapper takes the fast kernel only inside its backend's own
forward pass (``inside``: the thread that runs it), for arrays big enough to
pay; everyone else, such as mlx-lm's own generation on the same model, gets
what was there before. Wrappers of several backends (two engines of one
model family) stack: each passes on what it does not take.

A gated-delta hybrid's recurrence (``mlx_lm.models.gated_delta``'s
``gated_delta_ops``, which every such family reaches through
``gated_delta_update`` off Metal) is wrapped the same way: a prefill chunk
runs in ``host_gated_delta``'s compiled loop once it has loaded. The short
depthwise convolution before such a recurrence (``nn.Conv1d``, which every
hybrid calls through the layer it holds) is wrapped on the class: its
``__call__`` takes the layer, and ``host_conv`` computes a chunk's.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from engine.runtime.runner.backends.cpu import cpu_math, host_conv, host_gated_delta

SWIGLU = "swiglu"
# Gemma 4's MLP calls its own ``geglu``, compiled shapeless around ``nn.gelu_approx``: a compiled function
# traces what it calls, and the fast GELU's bit cast (``view``) cannot be traced shapeless. Its module's
# name is wrapped instead, so the backend's forward never enters the compiled one.
GEGLU = "geglu"
# mlx-lm's module of the gated delta rule, and the step loop in it that runs wherever its Metal kernel does not.
GATED_DELTA_MODULE = "mlx_lm.models.gated_delta"
GATED_DELTA_OPS = "gated_delta_ops"
# mlx.nn's GELU module ("precise" and "tanh" alike) calls its own module's ``gelu_approx``, not ``nn.gelu_approx``:
# a vision tower's MLPs (mlx-vlm's SigLIP and Qwen-VL towers) reach it there.
ACTIVATIONS_MODULE = "mlx.nn.layers.activations"
ATTENTION = "scaled_dot_product_attention"  # mx.fast's: mlx-vlm's towers call it by this name
# ... or through mlx-vlm's helper of this name (Qwen3-VL's and Qwen3.5's towers), compiled (``mx.compile``): a
# compiled function replays its first trace, so it is wrapped by name in each mlx-vlm module that imported it.
VLM_ATTENTION = "ensure_fused_sdpa"


def _big_enough(first: Any) -> bool:
    return first.size >= cpu_math.MIN_ELEMENTS


class _Wrapper:
    """``fast`` inside the backend's forward where ``applies`` (arrays of ``MIN_ELEMENTS`` or more), else
    ``previous``; a ``fast`` that returns None passes the call on too."""

    def __init__(self, fast: Callable[..., Any], previous: Callable[..., Any], inside: Callable[[], bool],
                 applies: Callable[[Any], bool] = _big_enough) -> None:
        self.fast = fast
        self.previous = previous
        self.inside = inside
        self.applies = applies
        self.live = True
        self.__wrapped__ = previous

    def __call__(self, first: Any, *rest: Any, **keywords: Any) -> Any:
        if self.live and self.applies(first) and self.inside():
            out = self.fast(first, *rest, **keywords)
            if out is not None:
                return out
        return self.previous(first, *rest, **keywords)

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        """On a class (``nn.Conv1d.__call__``) it binds like the method it wraps: the instance comes first."""
        return self if instance is None else types.MethodType(self, instance)


class _AttentionWrapper(_Wrapper):
    """``mx.fast.scaled_dot_product_attention``, called with keywords: ``fast(queries, keys, values, scale, mask)``
    where it applies (``sinks`` and any other keyword pass the call on)."""

    def __call__(self, queries: Any, keys: Any, values: Any, *, scale: float, mask: Any = None,
                 **rest: Any) -> Any:
        # inside() first: the text model's own calls (every decode step's, where MLX's kernel runs) pay one test
        if self.live and not rest and self.inside() and self.applies(queries):
            out = self.fast(queries, keys, values, scale, mask)
            if out is not None:
                return out
        return self.previous(queries, keys, values, scale=scale, mask=mask, **rest)


# What MLX raises where an array is evaluated inside ``mx.compile`` (the host attention evaluates its blocks).
_UNDER_TRANSFORMATION = "function transformations"


def _outside_transformations(fast: Callable[..., Any]) -> Callable[..., Any]:
    """``fast``, passing the call on (None) where it runs inside a compiled helper of a tower (mlx-vlm compiles
    some, ``chunked_attention``): MLX's own kernel is traced there."""

    def call(*args: Any) -> Any:
        try:
            return fast(*args)
        except ValueError as exc:
            if _UNDER_TRANSFORMATION not in str(exc):
                raise
            return None

    return call


def _many_queries(queries: Any) -> bool:
    return queries.shape[2] > 1


@dataclass(slots=True)
class _Patch:
    namespace: Any
    name: str
    wrapper: _Wrapper


class ActivationHooks:
    """The wrappers one backend put in place for one model."""

    def __init__(self, inside: Callable[[], bool]) -> None:
        self._inside = inside
        self._patches: list[_Patch] = []

    def install(self, model: Any) -> None:
        for module in _modules_of(model):
            if callable(getattr(module, SWIGLU, None)):
                # mlx-lm's name; the fast one is looked up per call, so tests can count calls.
                self._wrap(module, SWIGLU, lambda gate, x: cpu_math.swiglu(gate, x))
            if callable(getattr(module, GEGLU, None)):
                self._wrap(module, GEGLU, lambda gate, x: cpu_math.geglu(gate, x))
        self._wrap(nn, "gelu_approx", lambda x: cpu_math.gelu_approx(x))

    def install_vision(self, inside_vision: Callable[[], bool], attention: Callable[..., Any]) -> None:
        """A vision tower's GELU and SiLU (``cpu_math``) and attention (``attention(queries, keys, values, scale,
        mask)``) inside the backend's vision passes only (``inside_vision``): the tower is mlx-vlm's, not the
        attached model, and reaches them through the namespaces of ``mlx.nn``, its GELU module and ``mx.fast``."""
        # The activations trace inside ``mx.compile`` as they run, but not inside a shapeless one (cpu_math's bit
        # cast): no served family's tower calls them there (each family's tower runs the pass in
        # tests/model/test_vision_real.py).
        activations = sys.modules[ACTIVATIONS_MODULE]
        for namespace, name in ((activations, "gelu_approx"), (activations, "gelu_fast_approx"),
                                (nn, "silu")):  # Qwen2.5-VL's tower calls ``nn.silu``
            # (looked up per call, so tests can count calls)
            self._wrap(namespace, name, lambda x, name=name: getattr(cpu_math, name)(x), inside=inside_vision)
        attention = _outside_transformations(attention)
        self._wrap(mx.fast, ATTENTION, attention, applies=_many_queries, inside=inside_vision,
                   wrapper=_AttentionWrapper)
        for name, module in sorted(sys.modules.items()):
            if name.startswith("mlx_vlm.") and callable(getattr(module, VLM_ATTENTION, None)):
                self._wrap(module, VLM_ATTENTION, lambda q, k, v, scale, mask=None: attention(q, k, v, scale, mask),
                           applies=_many_queries, inside=inside_vision)

    def install_gated_delta(self, model: Any, ready: Callable[[], bool]) -> bool:
        """Route ``model``'s gated-delta prefill chunks through the compiled loop once ``ready`` (it loads in
        the background); False when the model has no gated-delta layer."""
        steps = sys.modules.get(GATED_DELTA_MODULE)
        uses = any(getattr(module, "gated_delta_update", None) is not None for module in _modules_of(model))
        if steps is None or not uses or not callable(getattr(steps, GATED_DELTA_OPS, None)):
            return False

        def fast(q: Any, *rest: Any) -> Any:
            return host_gated_delta.steps(q, *rest) if ready() else None

        self._wrap(steps, GATED_DELTA_OPS, fast, applies=host_gated_delta.long_enough)
        return True

    def install_depthwise_conv(self, model: Any, ready: Callable[[], bool]) -> bool:
        """Route ``model``'s depthwise ``nn.Conv1d`` prefill chunks through the compiled loop once ``ready``;
        False when the model has no such layer."""
        convs = [m for _, m in model.named_modules() if isinstance(m, nn.Conv1d)]
        if not any(m.groups == m.weight.shape[0] > 1 for m in convs):
            return False

        def fast(conv: Any, x: Any) -> Any:
            return host_conv.depthwise(conv, x) if ready() else None

        self._wrap(nn.Conv1d, "__call__", fast, applies=lambda conv: True)
        return True

    def uninstall(self) -> None:
        for patch in reversed(self._patches):
            patch.wrapper.live = False
            if getattr(patch.namespace, patch.name) is patch.wrapper:
                setattr(patch.namespace, patch.name, _first_live(patch.wrapper.previous))
        self._patches = []

    def _wrap(self, namespace: Any, name: str, fast: Callable[..., Any],
              applies: Callable[[Any], bool] = _big_enough, inside: Callable[[], bool] | None = None,
              wrapper: type[_Wrapper] = _Wrapper) -> None:
        made = wrapper(fast, _first_live(getattr(namespace, name)), inside or self._inside, applies)
        setattr(namespace, name, made)
        self._patches.append(_Patch(namespace, name, made))


def _first_live(function: Any) -> Any:
    """``function``, or under the wrappers of backends that have detached, the first one still in use."""
    while isinstance(function, _Wrapper) and not function.live:
        function = function.previous
    return function


def _modules_of(model: Any) -> list[Any]:
    """The loaded modules that define ``model``'s classes, in name order."""
    names = {type(m).__module__ for _, m in model.named_modules()} | {type(model).__module__}
    return [sys.modules[name] for name in sorted(names) if name in sys.modules]
