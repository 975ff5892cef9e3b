"""The reference cache: a plain mlx-lm answer is computed once per distinct question, and only then."""

from __future__ import annotations

import mlx.core as mx
import pytest

from tests.support import reference
from tests.support.byte_tokenizer import BOS, EOS
from tests.support.tiny_models import tiny_llama

pytestmark = pytest.mark.unit


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty cache on disk and in memory, for this test alone."""
    monkeypatch.setenv(reference.CACHE_VARIABLE, str(tmp_path))
    monkeypatch.setattr(reference, "_memory", {})
    return tmp_path


def test_an_answer_is_computed_once_then_read_from_memory_and_from_disk(fresh, monkeypatch) -> None:
    model = tiny_llama(3)
    calls = []
    real = reference._greedy
    monkeypatch.setattr(reference, "_greedy", lambda *a: calls.append(a) or real(*a))
    prompt = [BOS, *b"hello there"]
    first = reference.reference_greedy(model, prompt, 8, {EOS})
    assert reference.reference_greedy(model, prompt, 8, {EOS}) == first and len(calls) == 1
    assert len(list(fresh.glob("greedy-*.json"))) == 1
    monkeypatch.setattr(reference, "_memory", {})  # a later session: the disk has it
    assert reference.reference_greedy(model, prompt, 8, {EOS}) == first and len(calls) == 1
    assert first == real(model, prompt, 8, {EOS})  # and it is what mlx-lm says


def test_another_prompt_setting_or_weight_is_another_question(fresh, monkeypatch) -> None:
    model = tiny_llama(3)
    calls = []
    real = reference._greedy
    monkeypatch.setattr(reference, "_greedy", lambda *a: calls.append(a) or real(*a))
    prompt = [BOS, *b"hello there"]
    reference.reference_greedy(model, prompt, 8, {EOS})
    reference.reference_greedy(model, [*prompt, 33], 8, {EOS})
    reference.reference_greedy(model, prompt, 9, {EOS})
    other = tiny_llama(3)
    other.model.norm.weight = other.model.norm.weight + 1e-3  # one weight changed
    mx.eval(other.parameters())
    assert reference.model_digest(other) != reference.model_digest(model)
    reference.reference_greedy(other, prompt, 8, {EOS})
    assert len(calls) == 4


def test_shared_references_fill_the_same_entries(fresh, monkeypatch) -> None:
    model = tiny_llama(5)
    prompts = [[BOS, *b"the common head, then one"], [BOS, *b"the common head, then two"]]
    shared = reference.reference_greedy_shared(model, prompts, 6, {EOS})
    monkeypatch.setattr(reference, "_greedy", lambda *a: pytest.fail("computed again"))
    assert [reference.reference_greedy(model, p, 6, {EOS}) for p in prompts] == shared
