"""Models whose layers keep two caches each (mlx-lm's ``CacheList``), through the engine, against plain mlx-lm.

Falcon-H1 keeps a Mamba state beside each layer's K/V, Baichuan M1 a
convolution window of its keys and values beside them (a sliding window on
some layers), LongCat Flash two attention passes' K/V, DeepSeek V3.2 its
sparse-attention indexer's keys beside the latent K/V. The spec makes each
member a cache layer of its own kind (``cache_lists`` says which go
together) and the model gets a ``CacheList`` of them. Tiny random-weight
instances of mlx-lm's own classes, from mlx-lm's test configs; every turn is
token-identical to ``generate_step`` on the same prompt.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.domain.event_log import EventLog
from engine.domain.requests import GenerationRequest
from engine.runtime.engine_thread.engine_ops import EvictAgent
from engine.runtime.engine_thread.sync_client import run_turn
from engine.runtime.tiers.agents import Tier
from engine.store.warm_store import WarmStore
from engine.store.stored_model import stored_model
from tests.support.family_engine import accounts_agree, batched_then_second_turns, check, opening, start
from tests.support.tiny_models import CACHE_LIST_FAMILIES, loaded_tiny

pytestmark = pytest.mark.unit

TOKENS = 8


@pytest.fixture(scope="module", params=CACHE_LIST_FAMILIES)
def loaded(request):
    return loaded_tiny(request.param)


def test_each_layer_takes_its_caches_together(loaded) -> None:
    spec = loaded.spec
    model_layers = len(loaded.model.make_cache())
    assert len(spec.cache_lists) == model_layers and spec.n_layers == 2 * model_layers
    assert f"{model_layers} model layers keep two caches each" in spec.layer_summary()
    assert spec.describe()["cache_lists"] == [list(entry) for entry in spec.cache_lists]


def test_turns_are_token_identical_reuse_the_cache_and_come_back_from_disk(loaded, tmp_path: Path) -> None:
    engine = start(loaded, WarmStore(tmp_path, stored_model(loaded), 1 << 30, EventLog()))
    prompt = opening(2)
    try:
        cached = 0
        for turn in range(3):
            result = run_turn(engine, GenerationRequest("chat", prompt, TOKENS))
            check(loaded, result)
            if turn:
                assert result.finish.usage.reused_tokens >= cached - 1, result.finish.usage
            accounts_agree(engine)
            cached = len(prompt) + len(result.tokens)
            prompt = prompt + tuple(result.tokens) + tuple(f" then turn {turn} says more.".encode())
        engine.call(EvictAgent("chat", Tier.WARM)).result(30)
    finally:
        engine.stop()
    engine = start(loaded, WarmStore(tmp_path, stored_model(loaded), 1 << 30, EventLog()))
    try:
        result = run_turn(engine, GenerationRequest("chat", prompt, TOKENS))
        check(loaded, result)
        assert result.finish.usage.reused_tokens >= cached - 1, result.finish.usage
        accounts_agree(engine)
    finally:
        engine.stop()


def test_agents_batched_together_equal_single_stream(loaded) -> None:
    batched_then_second_turns(loaded, 3, TOKENS)


def test_a_model_whose_layers_keep_two_caches_cannot_be_sharded_and_says_so() -> None:
    from engine.distributed.sharded_loading import check_shardable
    from engine.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="two caches in some layers"):
        check_shardable(loaded_tiny("longcat_flash").spec, "tiny-longcat_flash")
