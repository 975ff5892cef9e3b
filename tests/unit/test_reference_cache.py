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


def test_a_larger_cap_answers_a_smaller_one_and_an_ended_answer_any_cap(fresh, monkeypatch) -> None:
    model = tiny_llama(7)
    calls = []
    real = reference._greedy
    monkeypatch.setattr(reference, "_greedy", lambda *a: calls.append(a[2]) or real(*a))
    prompt = [BOS, *b"count on"]
    long = reference.reference_greedy(model, prompt, 12, set())
    assert reference.reference_greedy(model, prompt, 5, set()) == long[:5] == real(model, prompt, 5, set())
    assert calls == [12]
    assert len(reference.reference_greedy(model, prompt, 20, set())) == 20 and calls == [12, 20]  # not enough: again
    ends = {long[3]}  # an EOS set under which the answer ends at its fourth token
    ended = reference.reference_greedy(model, prompt, 12, ends)
    assert reference.reference_greedy(model, prompt, 400, ends) == ended == long[:long.index(long[3]) + 1]
    assert calls == [12, 20, 12]


@pytest.mark.parametrize("build", ["llama", "gemma3", "qwen3_5", "falcon_h1"])
def test_a_prompt_resumed_from_anothers_chunks_gets_the_answer_of_a_prefill_from_scratch(fresh, monkeypatch,
                                                                                         build) -> None:
    """Bit for bit: the same chunks at the same positions (attention, a rotating window, a recurrent state, a
    layer of two caches)."""
    from mlx_lm.generate import generate_step

    from tests.support import tiny_models

    model = tiny_llama(11) if build == "llama" else tiny_models.tiny_gemma3(11, window=12) if build == "gemma3" \
        else tiny_models.tiny_family(build, 11)
    monkeypatch.setattr(reference, "PREFILL_STEP", 8)
    monkeypatch.setattr(reference, "_snapshots", reference.OrderedDict())
    monkeypatch.setattr(reference, "_snapshot_bytes", 0)
    head = [BOS, *b"a head of three whole chunks.."]  # 31 tokens: chunks end at 8, 16, 24

    def scratch(prompt: list[int]) -> list[int]:
        steps = generate_step(mx.array(prompt), model, max_tokens=6, prefill_step_size=8)
        return reference._collect(steps, 6, set())

    before = reference.STATS.resumed_tokens
    first = reference.reference_greedy(model, [*head, *b"one"], 6, set())
    second = reference.reference_greedy(model, [*head, *b"two!"], 6, set())
    third = reference.reference_greedy(model, [*head[:20], *b"elsewhere"], 6, set())
    again = reference.reference_greedy(model, [*head, *b"also"], 6, set())  # after the second decoded from 24
    edge = reference.reference_greedy(model, [*head, *b"ab"], 6, set())  # 33 tokens: from "also"'s chunk at 32,
    whole = reference.reference_greedy(model, [*head, *b"x"], 6, set())  # 32: its chunk at 32 would leave nothing
    assert reference.STATS.resumed_tokens - before == 24 + 16 + 24 + 32 + 24  # (the last token is the first step's)
    assert (first, second, third, again, edge, whole) == tuple(map(scratch, (
        [*head, *b"one"], [*head, *b"two!"], [*head[:20], *b"elsewhere"], [*head, *b"also"], [*head, *b"ab"],
        [*head, *b"x"])))
