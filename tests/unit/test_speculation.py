"""Speculative decoding: drafting from a sequence's history, the acceptance rules, and the batch on tiny models."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from engine.domain.requests import GenerationRequest, SamplingParams
from engine.domain.speculation_tally import SpeculationTally
from engine.models.draft_model import DraftModel
from engine.runtime.runner.model_drafting import DraftCaches
from engine.runtime.engine_thread.engine import Engine
from engine.runtime.engine_thread.sync_client import run_turn, run_turns
from engine.runtime.runner.drafting import DraftLength, LookupDrafter
from engine.runtime.runner.sampling import RowSampler
from engine.runtime.runner.speculation import accepted_tokens, greedy_tokens
from tests.support.byte_tokenizer import BOS, EOS
from tests.support.engine_settings import engine_settings
from tests.support.reference import reference_greedy
from tests.support.tiny_models import loaded_tiny


# -- drafting ---------------------------------------------------------------------------------
def test_drafter_proposes_what_followed_the_latest_tokens_before() -> None:
    drafter = LookupDrafter([1, 2, 3, 4, 5, 6, 9, 1, 2, 3])
    assert drafter.propose(3) == [4, 5, 6]
    assert drafter.propose(10) == [4, 5, 6, 9, 1, 2, 3]  # up to the history's end
    assert LookupDrafter([1, 2, 3, 4, 5]).propose(4) == []  # nothing repeats
    assert drafter.propose(0) == []


def test_drafter_prefers_the_longest_match_then_the_latest() -> None:
    # [7, 1, 2, 3] occurs once with 8 after it; [1, 2, 3] later with 9 after it: the longer context wins.
    drafter = LookupDrafter([7, 1, 2, 3, 8, 5, 1, 2, 3, 9, 6, 7, 1, 2, 3])
    assert drafter.propose(1) == [8]
    tie = LookupDrafter([1, 2, 3, 8, 1, 2, 3, 9, 1, 2, 3])
    assert tie.propose(1) == [9]


def test_drafter_built_at_once_equals_drafter_extended_token_by_token() -> None:
    rng = np.random.default_rng(0)
    history = rng.integers(0, 6, 400).tolist()
    whole = LookupDrafter(history)
    grown = LookupDrafter(history[:10])
    for token in history[10:]:
        grown.extend([token])
    assert whole.propose(8) == grown.propose(8)


def test_draft_length_follows_acceptance_and_pauses_after_misses() -> None:
    length = DraftLength(most=8, start=4)
    assert length.next() == 4
    length.taken(4, 4)
    assert length.next() == 8
    length.taken(8, 8)
    assert length.next() == 8  # capped
    length.taken(8, 2)
    assert length.next() == 3  # what was taken, plus one
    for _ in range(3):
        length.taken(3, 0)
    assert [length.next() for _ in range(8)] == [0] * 8  # paused
    assert length.next() == 1


# -- acceptance ---------------------------------------------------------------------------------
def test_greedy_tokens_keep_drafts_while_they_equal_the_argmax() -> None:
    assert greedy_tokens([5, 6, 7], [5, 6]) == [5, 6, 7]
    assert greedy_tokens([5, 2, 7], [5, 6]) == [5, 2]
    assert greedy_tokens([4, 6, 7], [5, 6]) == [4]
    assert greedy_tokens([4], []) == [4]


def _distribution(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    z = np.exp((logits - logits.max()) / temperature)
    return z / z.sum()


@pytest.mark.parametrize("top_k", [0, 3])
def test_speculative_sampling_keeps_the_models_distribution(top_k: int) -> None:
    """Many draws of a two-token draft: the first emitted token follows p0 (the row's filtered distribution
    at its last token), the second, after the first draft was kept, follows p1; drafts outside top-k are
    never kept."""
    logits = np.array([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5],
                       [0.0, 1.0, 2.0, 0.5, -0.5, 1.0],
                       [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]], dtype=np.float32)
    drafts = [5, 2]
    p0, p1 = _distribution(logits[0]), _distribution(logits[1])
    if top_k:
        for p in (p0, p1):
            p[np.argsort(-p)[top_k:]] = 0
            p /= p.sum()
    draws = 6000
    sampler = RowSampler(SamplingParams(temperature=1.0, top_p=1.0, top_k=top_k, seed=7))
    firsts: Counter[int] = Counter()
    seconds: Counter[int] = Counter()
    for _ in range(draws):
        out = accepted_tokens(mx.array(logits), drafts, sampler)
        assert 1 <= len(out) <= 3
        firsts[out[0]] += 1
        if out[0] == drafts[0]:
            seconds[out[1]] += 1
    for token in range(6):
        assert abs(firsts[token] / draws - p0[token]) < 0.025, (token, firsts, p0)
    kept = sum(seconds.values())
    assert abs(kept / draws - p0[drafts[0]]) < 0.025
    for token in range(6):
        assert abs(seconds[token] / kept - p1[token]) < 0.04, (token, seconds, p1)


def test_tally_adds_and_derives() -> None:
    total = SpeculationTally(8, 6, 2, 8) + SpeculationTally(4, 0, 1, 1)
    assert (total.drafted, total.accepted, total.steps, total.emitted) == (12, 6, 3, 9)
    assert total.acceptance == 0.5 and total.tokens_per_step == 3.0


# -- the batch on tiny models ---------------------------------------------------------------------
def _as_if_small(monkeypatch: pytest.MonkeyPatch | None) -> None:
    # A draft model with the served model's own weights costs as much as it and would never draft
    # (allocate_drafts): price it as one a hundredth of the size, which it stands in for here.
    assert monkeypatch is not None, "a draft model's engine needs monkeypatch to price its drafts"
    monkeypatch.setattr(DraftCaches, "cost_share", lambda self, target: 0.01)


def make_engine(kind: str, speculate: str, batch: int = 8, max_draft: int = 8, block_tokens: int = 16,
                monkeypatch: pytest.MonkeyPatch | None = None) -> Engine:
    """``speculate`` "draft": a second copy of the tiny model's weights drafts for it."""
    loaded = loaded_tiny(kind, block_tokens=block_tokens)
    if speculate == "draft":
        loaded = replace(loaded, draft=DraftModel("tiny-draft", loaded_tiny(kind, block_tokens=block_tokens).model))
        _as_if_small(monkeypatch)
    engine = Engine(loaded, engine_settings(64 * 2**20, batch, 32, speculate=speculate, speculate_max_draft=max_draft))
    engine.start()
    return engine


def looping_prompt(i: int) -> tuple[int, ...]:
    """A prompt whose continuation a random tiny model soon repeats (so drafts get taken)."""
    return (BOS, *(f"{i} abc abc abc abc abc abc ".encode()))


def without_eos(tokens: list[int]) -> list[int]:
    return tokens[:-1] if tokens and tokens[-1] == EOS else tokens


@pytest.fixture(params=["llama", "gemma"])
def kind(request) -> str:
    return request.param


def test_greedy_outputs_equal_plain_decoding_alone_and_batched(kind: str) -> None:
    on, off = make_engine(kind, "lookup"), make_engine(kind, "off")
    try:
        requests = [GenerationRequest(f"a{i}", looping_prompt(i), 48) for i in range(4)]
        mixed = run_turns(on, requests)
        alone = [run_turn(on, GenerationRequest(f"b{i}", r.prompt_tokens, 48)) for i, r in enumerate(requests)]
        plain = run_turns(off, [GenerationRequest(f"c{i}", r.prompt_tokens, 48) for i, r in enumerate(requests)])
        for m, a, p, r in zip(mixed, alone, plain, requests):
            expected = without_eos(reference_greedy(on.loaded.model, list(r.prompt_tokens), 48, {EOS}))
            assert m.tokens == a.tokens == p.tokens == expected
            assert m.finish.usage.generated_tokens == p.finish.usage.generated_tokens
            assert p.finish.usage.speculation is None
        tallies = [m.finish.usage.speculation for m in mixed + alone]
        assert all(t is not None for t in tallies)
        assert sum(t.accepted for t in tallies) > 0, "the looping prompts should have had drafts kept"
        assert sum(t.emitted for t in tallies) > sum(t.steps for t in tallies)
    finally:
        on.stop()
        off.stop()


def test_next_turn_reuses_every_token_of_a_speculative_turn(kind: str) -> None:
    engine = make_engine(kind, "lookup")
    try:
        first = run_turn(engine, GenerationRequest("a", looping_prompt(1), 40))
        assert first.finish.usage.speculation.accepted > 0
        follow = first.request.prompt_tokens + tuple(first.tokens) + tuple(b" more")
        second = run_turn(engine, GenerationRequest("a", follow, 16))
        cached = len(first.request.prompt_tokens) + first.finish.usage.generated_tokens
        assert second.finish.usage.reused_tokens == min(cached, len(follow) - 1)
        expected = without_eos(reference_greedy(engine.loaded.model, list(follow), 16, {EOS}))
        assert second.tokens == expected
        view = engine.fresh_snapshot().agent("a")
        assert view.speculation.drafted >= first.finish.usage.speculation.drafted
    finally:
        engine.stop()


def test_sampled_rows_speculate_unless_seeded() -> None:
    engine = make_engine("llama", "lookup")
    try:
        unseeded = GenerationRequest("u", looping_prompt(2), 40, SamplingParams(temperature=0.3))
        seeded = GenerationRequest("s", looping_prompt(3), 40, SamplingParams(temperature=0.3, seed=11))
        greedy = GenerationRequest("g", looping_prompt(4), 40)
        u, s, g = run_turns(engine, [unseeded, seeded, greedy])
        assert u.finish.usage.speculation is not None
        assert s.finish.usage.speculation is None
        alone = run_turn(engine, GenerationRequest("s2", seeded.prompt_tokens, 40, seeded.sampling))
        assert s.tokens == alone.tokens  # a seed's tokens do not depend on the batch's speculation
        assert g.tokens == without_eos(reference_greedy(engine.loaded.model, list(greedy.prompt_tokens), 40, {EOS}))
    finally:
        engine.stop()


def test_batch_stops_speculating_for_a_while_when_its_steps_fall_behind_plain_ones() -> None:
    from engine.runtime.runner.step_rates import FIRST_PAUSE, StepRates

    rates = StepRates()
    for _ in range(6):
        rates.plain_step(rows=4, seconds=0.05)  # 20 tokens a second a row
    for _ in range(6):
        rates.speculative_step(rows=4, tokens=8, seconds=0.05)  # 40: it pays
    assert rates.allowed() and rates.pauses == 0
    for _ in range(12):
        rates.speculative_step(rows=4, tokens=4, seconds=0.08)  # 12.5: it does not
        if not rates.allowed():
            break
    assert not rates.allowed() and rates.pauses == 1
    for _ in range(FIRST_PAUSE):
        rates.plain_step(rows=4, seconds=0.05)
    assert rates.allowed()  # tried again after the pause
    while rates.allowed():
        rates.speculative_step(rows=4, tokens=4, seconds=0.08)
    assert rates.pauses == 2 and rates.paused_for == 2 * FIRST_PAUSE  # longer each time


def test_drafts_are_allocated_where_they_raise_tokens_per_second() -> None:
    from engine.runtime.runner.drafting import allocate_drafts

    assert allocate_drafts([(7, 0.9), (3, 0.1)], row_cost=0.0, rows=2) == [7, 3]  # free: verify everything
    copying = allocate_drafts([(7, 0.95)], row_cost=0.25, rows=1)[0]
    assert copying >= 5  # one agent copying a file: a long draft pays even on the CPU
    assert allocate_drafts([(7, 0.1)], row_cost=0.25, rows=1) == [0]  # prose: none
    crowded = allocate_drafts([(7, 0.6)] * 8, row_cost=0.25, rows=8)
    assert crowded == [0] * 8  # eight agents already fill the pass: a 60% draft costs more than it brings
    mixed = allocate_drafts([(7, 0.95), (7, 0.3)], row_cost=0.25, rows=4)
    assert mixed[0] > 0 and mixed[1] == 0  # the likely drafts go first
    # A draft model's drafts cost its decode steps: one as large as the served model never pays, even where
    # passes are free and every draft is kept; one a tenth of its size does on a GPU and on the CPU.
    assert allocate_drafts([(7, 1.0)], row_cost=0.0, rows=1, draft_cost=1.0) == [0]
    assert allocate_drafts([(7, 1.0)], row_cost=0.25, rows=1, draft_cost=1.0) == [0]
    assert allocate_drafts([(7, 0.9)], row_cost=0.0, rows=1, draft_cost=0.1)[0] >= 5
    # Where a drafted token costs less than a sequence's own row (the CPU's host path), eight agents' likely
    # drafts pay although the rows fill the pass; the rows' own cost still prices the pass.
    assert allocate_drafts([(7, 0.6)] * 8, row_cost=0.3, rows=8) == [0] * 8
    cheap = allocate_drafts([(7, 0.6)] * 8, row_cost=0.3, rows=8, token_cost=0.13)
    assert all(n >= 1 for n in cheap)
    assert allocate_drafts([(7, 0.2)] * 8, row_cost=0.3, rows=8, token_cost=0.13) == [0] * 8  # prose: still none
    assert allocate_drafts([(7, 0.9)], row_cost=0.25, rows=1, draft_cost=0.1)[0] >= 3


def test_sliding_window_rings_get_back_what_rejected_drafts_overwrote(monkeypatch: pytest.MonkeyPatch) -> None:
    """A window of 24 tokens in a ring of 24 (blocks of 8: no slack), prompts and answers past it: rejected
    drafts overwrite ring columns the next step still needs, and the step puts them back; greedy tokens stay
    plain decoding's."""
    from engine.runtime.runner.kv.window_kv import WindowKV

    restored = []
    original = WindowKV.undo

    def counting(self, saved, n_tokens):
        if saved.keys is not None and n_tokens < self.offset:
            restored.append(self.offset - n_tokens)
        return original(self, saved, n_tokens)

    monkeypatch.setattr(WindowKV, "undo", counting)
    engine = make_engine("gemma", "lookup", block_tokens=8)
    try:
        requests = [GenerationRequest(f"w{i}", looping_prompt(i), 64) for i in range(3)]
        results = run_turns(engine, requests)
        for result, request in zip(results, requests):
            expected = without_eos(reference_greedy(engine.loaded.model, list(request.prompt_tokens), 64, {EOS}))
            assert result.tokens == expected
        assert restored, "no rejected draft overwrote a full ring: the test proves nothing"
    finally:
        engine.stop()


@pytest.mark.parametrize("drafts", ["lookup", "draft"])
def test_sampled_turns_keep_the_models_distribution_with_speculation(monkeypatch: pytest.MonkeyPatch,
                                                                     drafts: str) -> None:
    """Many unseeded sampled turns of a tiny model on a prompt it continues by repeating itself: the tokens
    at each position follow the same distribution with speculation (drafts looked up, or from a draft model)
    as without (a two-sample chi-square test per position at 0.1%; the requests' keys come from a fixed
    generator, so the test is repeatable)."""
    import random

    rng = random.Random(1234)
    monkeypatch.setattr("engine.runtime.runner.sampling.os.urandom", lambda n: rng.randbytes(n))
    # The batch's clock would stop speculating wherever a tiny model's verification costs more than its plain
    # steps (on a slow or busy machine): how many drafts are verified would then depend on the machine. The
    # test is about what verification keeps, so the batch always speculates here.
    monkeypatch.setattr("engine.runtime.runner.step_rates.StepRates.allowed", lambda self: True)
    prompt = looping_prompt(5)
    length, draws, together = 8, 320, 2  # (two at a time: a crowded CPU pass would verify no drafts at all)
    tokens: dict[str, list[list[int]]] = {}
    kept = 0
    for mode in (drafts, "off"):
        engine = make_engine("llama", mode, monkeypatch=monkeypatch)
        try:
            tokens[mode] = []
            for start in range(0, draws, together):
                batch = [GenerationRequest(f"{mode}-{start + i}", prompt, length, SamplingParams(temperature=0.3))
                         for i in range(together)]
                results = run_turns(engine, batch)
                tokens[mode] += [r.tokens for r in results]
                kept += sum(r.finish.usage.speculation.accepted for r in results if r.finish.usage.speculation)
        finally:
            engine.stop()
    assert kept > draws // 4, "too few drafts were kept for the test to say anything"
    varied = 0
    for position in range(1, length):
        on = Counter(t[position] for t in tokens[drafts] if len(t) > position)
        off = Counter(t[position] for t in tokens["off"] if len(t) > position)
        statistic, freedom = _chi_square(on, off)
        assert freedom == 0 or statistic < _chi_square_critical(freedom), (position, on, off)
        varied += freedom >= 2
    assert varied >= 3, "the positions' tokens barely vary: the test would pass whatever the sampling did"


def _chi_square(a: Counter[int], b: Counter[int]) -> tuple[float, int]:
    """The two-sample chi-square statistic and its degrees of freedom, categories expected fewer than 5 times
    pooled into one."""
    na, nb = sum(a.values()), sum(b.values())
    total = na + nb
    cells, rare = [], [0, 0]
    for token in set(a) | set(b):
        if (a[token] + b[token]) * min(na, nb) / total < 5:
            rare[0] += a[token]
            rare[1] += b[token]
        else:
            cells.append((a[token], b[token]))
    if sum(rare):
        cells.append((rare[0], rare[1]))
    statistic = 0.0
    for x, y in cells:
        row = x + y
        for observed, n in ((x, na), (y, nb)):
            expected = row * n / total
            statistic += (observed - expected) ** 2 / expected
    return statistic, len(cells) - 1


def _chi_square_critical(freedom: int, z: float = 3.09) -> float:
    """The 0.1% critical value (Wilson-Hilferty: the cube root of chi-square over its freedom is close to normal)."""
    k = float(freedom)
    return k * (1 - 2 / (9 * k) + z * (2 / (9 * k)) ** 0.5) ** 3


async def test_the_api_reports_speculation_per_turn_per_agent_and_in_metrics(tmp_path) -> None:
    """A client of the OpenAI API sees the turn's drafts in ``usage.semantic.speculation``; the agent, the stats
    and the Prometheus counters add them up."""
    import httpx

    from engine.api.app import create_app
    from tests.support.router_app import LiveServer, make_service

    engine = make_engine("llama", "lookup")
    try:
        with LiveServer(create_app(make_service(tmp_path, engine))) as server:  # type: ignore[arg-type]
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                body = {"model": "m", "session_id": "copier", "max_tokens": 40, "temperature": 0,
                        "messages": [{"role": "user", "content": "abc abc abc abc abc abc abc abc"}]}
                response = await client.post("/v1/chat/completions", json=body)
                assert response.status_code == 200, response.text
                turn = response.json()["usage"]["semantic"]["speculation"]
                assert set(turn) == {"drafted", "accepted", "acceptance", "steps", "emitted", "tokens_per_step"}
                assert turn["drafted"] > 0 and 0 <= turn["accepted"] <= turn["drafted"]
                agent = (await client.get("/v1/agents/oa-copier")).json()["speculation"]
                assert (agent["drafted"], agent["accepted"]) == (turn["drafted"], turn["accepted"])
                stats = (await client.get("/v1/stats")).json()
                assert stats["throughput"]["speculation"]["drafted"] == turn["drafted"]
                metrics = (await client.get("/metrics")).text
                assert f"semantic_speculative_drafted_tokens_total {float(turn['drafted'])}" in metrics
                assert f"semantic_speculative_accepted_tokens_total {float(turn['accepted'])}" in metrics
    finally:
        engine.stop(0.0)
