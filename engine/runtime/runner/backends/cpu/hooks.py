"""The CPU backend's SiLU and GELU: functions of mlx-lm's and ``mlx.nn``'s namespaces, wrapped while attached.

Why patch a namespace: mlx-lm's MLPs call ``swiglu`` by the name their module
imported, and Gemma's call ``nn.gelu_approx`` through ``mlx.nn``; they take
arrays only, no cache through which the engine could route them. So the
backend wraps those names when it attaches a model and unwraps them when it
detaches. A wrapper takes the fast kernel only inside its backend's own
forward pass (``inside``: the thread that runs it), for arrays big enough to
pay; everyone else, such as mlx-lm's own generation on the same model, gets
what was there before. Wrappers of several backends (two engines of one
model family) stack: each passes on what it does not take.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable

import mlx.nn as nn

from engine.runtime.runner.backends.cpu import cpu_math

SWIGLU = "swiglu"
# Gemma 4's MLP calls its own ``geglu``, compiled shapeless around ``nn.gelu_approx``: a compiled function
# traces what it calls, and the fast GELU's bit cast (``view``) cannot be traced shapeless. Its module's
# name is wrapped instead, so the backend's forward never enters the compiled one.
GEGLU = "geglu"


class _Wrapper:
    """``fast`` inside the backend's forward for arrays of ``MIN_ELEMENTS`` or more, else ``previous``."""

    def __init__(self, fast: Callable[..., Any], previous: Callable[..., Any], inside: Callable[[], bool]) -> None:
        self.fast = fast
        self.previous = previous
        self.inside = inside
        self.live = True
        self.__wrapped__ = previous

    def __call__(self, first: Any, *rest: Any) -> Any:
        if self.live and first.size >= cpu_math.MIN_ELEMENTS and self.inside():
            return self.fast(first, *rest)
        return self.previous(first, *rest)


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
        modules = {type(m).__module__ for _, m in model.named_modules()} | {type(model).__module__}
        for name in sorted(modules):
            module = sys.modules.get(name)
            if module is not None and callable(getattr(module, SWIGLU, None)):
                # mlx-lm's name; the fast one is looked up per call, so tests can count calls.
                self._wrap(module, SWIGLU, lambda gate, x: cpu_math.swiglu(gate, x))
            if module is not None and callable(getattr(module, GEGLU, None)):
                self._wrap(module, GEGLU, lambda gate, x: cpu_math.geglu(gate, x))
        self._wrap(nn, "gelu_approx", lambda x: cpu_math.gelu_approx(x))

    def uninstall(self) -> None:
        for patch in reversed(self._patches):
            patch.wrapper.live = False
            if getattr(patch.namespace, patch.name) is patch.wrapper:
                setattr(patch.namespace, patch.name, _first_live(patch.wrapper.previous))
        self._patches = []

    def _wrap(self, namespace: Any, name: str, fast: Callable[..., Any]) -> None:
        wrapper = _Wrapper(fast, _first_live(getattr(namespace, name)), self._inside)
        setattr(namespace, name, wrapper)
        self._patches.append(_Patch(namespace, name, wrapper))


def _first_live(function: Any) -> Any:
    """``function``, or under the wrappers of backends that have detached, the first one still in use."""
    while isinstance(function, _Wrapper) and not function.live:
        function = function.previous
    return function
