"""An engine on a tiny family model, and the checks the family tests share (tests/unit/test_*_families.py)."""

from __future__ import annotations

from engine.runtime.engine_thread.engine import Engine
from engine.runtime.engine_thread.sync_client import TurnResult
from engine.runtime.tiers.accounting import held_bytes
from engine.store.warm_store import WarmStore
from tests.support.byte_tokenizer import BOS, EOS
from tests.support.engine_settings import engine_settings
from tests.support.reference import reference_greedy


def start(loaded, store: WarmStore | None = None, blocks: int | None = None, **settings) -> Engine:
    """A started engine with a pool of ``blocks`` blocks (64 MiB when None)."""
    budget = blocks * loaded.spec.block_bytes if blocks else 64 << 20
    engine = Engine(loaded, engine_settings(budget, 8, 32, **settings), store=store)
    engine.start()
    return engine


def expected(loaded, prompt: tuple[int, ...], n: int) -> list[int]:
    """Plain mlx-lm's greedy tokens for ``prompt``, without a final EOS (the engine does not deliver it)."""
    tokens = reference_greedy(loaded.model, list(prompt), n, {EOS})
    return tokens[:-1] if tokens and tokens[-1] == EOS else tokens


def check(loaded, result: TurnResult) -> None:
    """The turn ended without error and said what plain mlx-lm says."""
    assert result.finish.error is None, result.finish.error
    assert result.tokens == expected(loaded, result.request.prompt_tokens, result.request.max_tokens)


def accounts_agree(engine: Engine) -> None:
    """The pool counts exactly the bytes the agents' arrays hold."""
    held, counted = engine.call(lambda e: (held_bytes(e.agents), e.pool.used_bytes)).result(30)
    assert held == counted


def opening(i: int = 1) -> tuple[int, ...]:
    return (BOS, *(f"agent {i} opens a conversation about caches. " * 2).encode())
