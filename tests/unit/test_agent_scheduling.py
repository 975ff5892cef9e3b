"""Agent-aware scheduling (docs/scheduling.md): levels and aging, the order turns are admitted and prefilled in,
an urgent turn overtaking a long prompt mid-prefill, pausing, paced prefill while agents decode, and eviction by
class; on a tiny random-weight Llama, every agent's tokens against plain greedy decoding."""

from __future__ import annotations

import queue
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Iterator

import pytest

from engine.domain.priority import AgentClass, PriorityPolicy, class_levels_from, parse_level
from engine.domain.requests import FinishEvent, GenerationRequest, PrefillEvent, TokenEvent
from engine.runtime.engine_thread.engine import Engine
from engine.runtime.runner.batch import REPLY_START_TOKENS
from engine.runtime.engine_thread.engine_ops import PauseAgent, SetAgentPriority
from engine.runtime.scheduler.admission import Admission
from engine.runtime.scheduler.turn_cache import TurnCaches
from engine.runtime.scheduler.prefill_pacer import FIRST_CHUNK, GAP_FLOOR_S, MIN_CHUNK, PrefillPacer
from engine.runtime.tiers.agent_table import AgentTable
from engine.runtime.tiers.agents import AgentRecord, Tier
from engine.settings import SchedulingSettings, Settings
from tests.support.byte_tokenizer import BOS, EOS
from tests.support.engine_settings import engine_settings
from tests.support.prefill_passes import record_prefill_passes
from tests.support.reference import reference_greedy
from tests.support.terminal import poll
from tests.support.tiny_models import loaded_tiny

pytestmark = pytest.mark.unit


# -- levels and aging ------------------------------------------------------------------------
def test_a_less_urgent_turn_is_overtaken_only_within_its_aging_window() -> None:
    policy = PriorityPolicy(aging_s=10.0)
    subagent_at_0 = policy.virtual_arrival(0.0, policy.level(AgentClass.SUBAGENT))
    # A main turn (level 1) arriving up to 20 s after a subagent's (level 3) goes first; one arriving later does not.
    assert policy.virtual_arrival(19.9, policy.level(AgentClass.MAIN)) < subagent_at_0
    assert policy.virtual_arrival(20.1, policy.level(AgentClass.MAIN)) > subagent_at_0
    assert policy.overtaken_for_at_most(3) == 30.0
    assert PriorityPolicy(enabled=False).virtual_arrival(5.0, 9) == 5.0


def test_the_operator_beats_the_request_which_beats_the_class() -> None:
    policy = PriorityPolicy()
    assert policy.level(AgentClass.SUBAGENT) == 3
    assert policy.level(AgentClass.SUBAGENT, asked=5) == 5
    assert policy.level(AgentClass.SUBAGENT, asked=5, operator=0) == 0


@pytest.mark.parametrize("value, level", [(0, 0), ("7", 7), ("background", 6), (" Main ", 1)])
def test_levels_read_as_numbers_or_class_names(value: object, level: int) -> None:
    assert parse_level(value, "priority") == level


@pytest.mark.parametrize("value", [10, -1, "urgent", True, 2.5])
def test_a_bad_level_names_its_field(value: object) -> None:
    with pytest.raises(ValueError, match="metadata.priority"):
        parse_level(value, "metadata.priority")


def test_class_defaults_are_settable_and_a_bad_one_is_refused_at_start() -> None:
    assert class_levels_from(("subagent=5",))[AgentClass.SUBAGENT] == 5
    with pytest.raises(ValueError, match="class_priorities"):
        Settings(class_priorities=("boss=1",))


# -- the pacer -----------------------------------------------------------------------------
def test_the_pacer_sizes_prefill_to_the_gap_it_measures() -> None:
    pacer = PrefillPacer(None, timed=True)
    assert pacer.budget(512) == FIRST_CHUNK  # nothing measured yet
    for n in (64, 128, 256, 512) * 4:
        pacer.observe(0.05, 0, 4)  # a decode-only step: 50 ms
        pacer.observe(0.05 + 0.02 + n * 0.002, n, 4)  # a pass: 20 ms whatever its size, 2 ms a prompt token
    assert pacer.gap_s == pytest.approx(0.3)  # six decode steps
    assert pacer.cost() == pytest.approx((0.02, 0.002))
    assert pacer.budget(512) == pytest.approx((0.3 - 0.05 - 0.02) / 0.002, abs=1)
    assert pacer.budget(64) == 64
    # Nobody decodes, a more urgent agent is expected back: steps of about the gap's floor, no decode work in them.
    assert pacer.budget(512, expected_only=True) == pytest.approx((GAP_FLOOR_S - 0.02) / 0.002, abs=1)
    slow = PrefillPacer(1.0, timed=True)  # a gap shorter than a decode step still moves the prompt
    slow.observe(0.05, 0, 4)
    slow.observe(0.05 + 0.2, 1, 4)
    assert slow.budget(512) == MIN_CHUNK


def test_small_chunks_do_not_talk_the_pacer_into_smaller_ones() -> None:
    """Steps of one size cannot separate a pass's fixed cost from its per-token cost; once sizes vary, the fixed
    part stops counting against every token (small chunks would otherwise look slow per token and shrink)."""
    pacer = PrefillPacer(300, timed=True)
    for _ in range(8):
        pacer.observe(0.02 + 32 * 0.002, 32, 0)
    assert pacer.budget(512) == int(0.3 / ((0.02 + 32 * 0.002) / 32))
    for n in (64, 256, 512):
        pacer.observe(0.02 + n * 0.002, n, 0)
    fixed, per_token = pacer.cost()
    assert fixed == pytest.approx(0.02) and per_token == pytest.approx(0.002)


def test_no_pacing_when_turned_off_or_under_lockstep() -> None:
    assert not PrefillPacer(0, timed=True).enabled
    assert not PrefillPacer(None, timed=False).enabled
    assert PrefillPacer(800, timed=True).gap_s == 0.8
    assert PrefillPacer(800, timed=True).expected_gap_s == 0.8  # a gap the operator set holds for both


# -- eviction by class ------------------------------------------------------------------------
def test_idle_caches_go_least_urgent_class_first_and_a_tool_loop_holds_its_own() -> None:
    table = AgentTable()
    records = {}
    for name, agent_class in (("main", AgentClass.MAIN), ("sub", AgentClass.SUBAGENT),
                              ("batch", AgentClass.BACKGROUND)):
        records[name] = table.add(AgentRecord(name, tier=Tier.HOT, agent_class=agent_class))
        table.touch(records[name])
    table.touch(records["main"])  # least recently used is now "sub", then "batch"
    assert [a.agent_id for a in table.eviction_order(set())] == ["batch", "sub", "main"]
    records["batch"].retain(60.0, time.monotonic())  # a reply that was a tool call: held while the tool runs
    assert [a.agent_id for a in table.eviction_order(set())] == ["sub", "main", "batch"]
    records["main"].priority = 9  # the operator's level outranks the class
    assert [a.agent_id for a in table.eviction_order(set())] == ["main", "sub", "batch"]


# -- the engine ---------------------------------------------------------------------------------
@contextmanager
def running_engine(batch: int = 4, prefill_step: int = 32, **scheduling: object) -> Iterator[Engine]:
    settings = replace(engine_settings(64 * 2**20, batch, prefill_step), scheduling=SchedulingSettings(**scheduling))
    engine = Engine(loaded_tiny("llama"), settings)
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


def prompt(text: str, repeat: int = 1) -> tuple[int, ...]:
    return (BOS, *(text * repeat).encode())


def expected(engine: Engine, request: GenerationRequest) -> list[int]:
    tokens = reference_greedy(engine.loaded.model, list(request.prompt_tokens), request.max_tokens, {EOS})
    return tokens[:-1] if tokens and tokens[-1] == EOS else tokens


class Timeline:
    """Every event of the turns submitted through it, with when it came, in one order."""

    def __init__(self) -> None:
        self.events: list[tuple[float, str, object]] = []
        self._lock = threading.Lock()
        self._finished: dict[str, queue.SimpleQueue] = {}

    def submit(self, engine: Engine, request: GenerationRequest) -> None:
        done: queue.SimpleQueue = queue.SimpleQueue()
        self._finished[request.agent_id] = done

        def sink(event: object) -> None:
            with self._lock:
                self.events.append((time.monotonic(), request.agent_id, event))
            if isinstance(event, FinishEvent):
                done.put(event)

        engine.submit(request, sink)

    def wait(self, agent_id: str, timeout_s: float = 120.0) -> FinishEvent:
        return self._finished[agent_id].get(timeout=timeout_s)

    def wait_until(self, done, what: str, timeout_s: float = 60.0) -> None:
        assert poll(done, timeout_s, interval_s=0.002), what

    def tokens(self, agent_id: str) -> list[int]:
        return [e.token_id for _, a, e in self.events if a == agent_id and isinstance(e, TokenEvent)]

    def first(self, agent_id: str, kind: type) -> int:
        """The index of the agent's first event of ``kind`` in the common order."""
        return next(i for i, (_, a, e) in enumerate(self.events) if a == agent_id and isinstance(e, kind))


def held(engine: Engine) -> threading.Event:
    """Hold the engine thread until the returned event is set: what is submitted meanwhile arrives together."""
    release = threading.Event()
    engine.call(lambda _: release.wait(30))
    return release


@pytest.mark.parametrize("priorities", [True, False])
def test_admission_goes_by_level_then_arrival_and_tokens_match_either_way(priorities: bool) -> None:
    with running_engine(batch=1, priorities=priorities) as engine:
        timeline = Timeline()
        release = held(engine)
        requests = [GenerationRequest("batch-job", prompt("nightly batch job. ", 3), 8, priority=6),
                    GenerationRequest("sub", prompt("a subagent reads files. ", 2), 8,
                                      agent_class=AgentClass.SUBAGENT),
                    GenerationRequest("person", prompt("a person asks. "), 8, agent_class=AgentClass.INTERACTIVE)]
        for request in requests:
            timeline.submit(engine, request)
        release.set()
        for request in requests:
            timeline.wait(request.agent_id)
            assert timeline.tokens(request.agent_id) == expected(engine, request)
        order = sorted(("batch-job", "sub", "person"), key=lambda a: timeline.first(a, TokenEvent))
        assert order == (["person", "sub", "batch-job"] if priorities else ["batch-job", "sub", "person"])


def main_turn_mid_long_prefill(engine: Engine, timeline: Timeline, sub_tokens: int,
                               main_tokens: int) -> tuple[GenerationRequest, GenerationRequest]:
    """A subagent's long prompt, and once its prefill has begun a main agent's short turn; both run to their end."""
    long = GenerationRequest("sub", prompt("a long file the subagent reads. ", 20), sub_tokens,
                             agent_class=AgentClass.SUBAGENT)
    timeline.submit(engine, long)
    timeline.wait_until(lambda: any(a == "sub" and isinstance(e, PrefillEvent) and e.done > 0
                                    for _, a, e in timeline.events), "the long prompt never started its prefill")
    short = GenerationRequest("main", prompt("the person's turn. "), main_tokens, agent_class=AgentClass.MAIN)
    timeline.submit(engine, short)
    timeline.wait("main")
    timeline.wait("sub")
    return long, short


def test_an_urgent_turn_overtakes_a_long_prompt_mid_prefill_which_resumes_intact() -> None:
    with running_engine(batch=4, prefill_step=32) as engine:
        timeline = Timeline()
        long, short = main_turn_mid_long_prefill(engine, timeline, 12, 6)
        # The main turn's first token came before the long prompt finished its prefill...
        assert timeline.first("main", TokenEvent) < timeline.first("sub", TokenEvent)
        progress = [e.done for _, a, e in timeline.events if a == "sub" and isinstance(e, PrefillEvent)]
        main_first = timeline.events[timeline.first("main", TokenEvent)][0]
        after = [e.done for t, a, e in timeline.events
                 if a == "sub" and isinstance(e, PrefillEvent) and t > main_first]
        assert after and min(after) > 0 and max(progress) > min(after)  # ...which resumed where it stopped
        assert timeline.tokens("main") == expected(engine, short)
        assert timeline.tokens("sub") == expected(engine, long)


def test_a_less_urgent_prompt_waits_out_the_urgent_replys_first_tokens() -> None:
    """The person sees text once the detokenizer has the reply's first word: those first decode steps run
    without a less urgent prompt's chunk beside them (at most the one step already in flight), then it resumes."""
    with running_engine(batch=4, prefill_step=32) as engine:
        timeline = Timeline()
        long, short = main_turn_mid_long_prefill(engine, timeline, 4, REPLY_START_TOKENS + 2)
        main_tokens = [i for i, (_, a, e) in enumerate(timeline.events) if a == "main" and isinstance(e, TokenEvent)]
        start, end = main_tokens[0], main_tokens[REPLY_START_TOKENS - 1]
        beside = [e for _, a, e in timeline.events[start:end] if a == "sub" and isinstance(e, PrefillEvent)]
        assert len(beside) <= 1, beside
        after = [e for _, a, e in timeline.events[end:] if a == "sub" and isinstance(e, PrefillEvent)]
        assert after, "the long prompt never resumed"
        assert timeline.tokens("main") == expected(engine, short)
        assert timeline.tokens("sub") == expected(engine, long)


def test_a_paused_agent_keeps_its_cache_and_resumes_with_the_same_tokens() -> None:
    with running_engine(batch=2) as engine:
        timeline = Timeline()
        request = GenerationRequest("worker", prompt("count slowly: "), 48)
        timeline.submit(engine, request)
        timeline.wait_until(lambda: len(timeline.tokens("worker")) >= 4, "the worker never decoded")
        engine.call(PauseAgent("worker", True)).result(10)
        time.sleep(0.1)  # a step already launched may still deliver its token
        paused_at = len(timeline.tokens("worker"))
        view = next(a for a in engine.fresh_snapshot().agents if a.agent_id == "worker")
        assert view.paused and view.tier == "hot"
        time.sleep(0.5)
        assert len(timeline.tokens("worker")) == paused_at, "a paused agent went on decoding"
        engine.call(PauseAgent("worker", False)).result(10)
        timeline.wait("worker")
        assert timeline.tokens("worker") == expected(engine, request)


def test_a_paused_agents_queued_turn_waits_while_others_go() -> None:
    with running_engine(batch=2) as engine:
        timeline = Timeline()
        first = GenerationRequest("paused", prompt("first turn. "), 4)
        timeline.submit(engine, first)
        timeline.wait("paused")
        engine.call(PauseAgent("paused", True)).result(10)
        second = GenerationRequest("paused", first.prompt_tokens + tuple(timeline.tokens("paused")) + (65,), 4)
        other = GenerationRequest("other", prompt("another agent. "), 4)
        timeline.submit(engine, second)
        timeline.submit(engine, other)
        timeline.wait("other")
        view = next(a for a in engine.fresh_snapshot().agents if a.agent_id == "paused")
        assert view.queue_position == 1 and view.paused
        engine.call(PauseAgent("paused", False)).result(10)
        finish = timeline.wait("paused")
        assert finish.usage.reused_tokens > 0  # its cache stayed while it waited


@pytest.mark.parametrize("gap_ms, paced", [(1.0, True), (0.0, False)])
def test_prefill_is_paced_while_an_agent_decodes(monkeypatch: pytest.MonkeyPatch, gap_ms: float, paced: bool) -> None:
    passes = record_prefill_passes(monkeypatch)
    with running_engine(batch=4, prefill_step=96, decode_gap_ms=gap_ms) as engine:
        timeline = Timeline()
        talker = GenerationRequest("talker", prompt("talk: "), 64)
        timeline.submit(engine, talker)
        timeline.wait_until(lambda: len(timeline.tokens("talker")) >= 8, "the talker never decoded")
        start = len(passes)
        reader = GenerationRequest("reader", prompt("a long document to read. ", 16), 4)
        timeline.submit(engine, reader)
        timeline.wait("reader")
        timeline.wait("talker")
        widths = [n for _, n in passes[start:]]
        if paced:  # a 1 ms gap leaves room for the fewest tokens a step carries
            assert max(widths[1:]) <= MIN_CHUNK, widths
        else:
            assert max(widths) == 96, widths
        assert timeline.tokens("reader") == expected(engine, reader)
        assert timeline.tokens("talker") == expected(engine, talker)


@pytest.mark.parametrize("main_was_here", [True, False])
def test_with_nothing_decoding_a_subagents_prompt_is_paced_only_while_a_main_agent_may_come_back(
        monkeypatch: pytest.MonkeyPatch, main_was_here: bool) -> None:
    passes = record_prefill_passes(monkeypatch)
    paced_for: list[bool] = []  # each paced step: whether only an agent expected back would wait on it
    budget = PrefillPacer.budget
    monkeypatch.setattr(PrefillPacer, "budget", lambda self, ceiling, expected_only=False: (
        paced_for.append(expected_only), budget(self, ceiling, expected_only))[1])
    with running_engine(batch=4, prefill_step=96, decode_gap_ms=1.0) as engine:
        timeline = Timeline()
        if main_was_here:  # a person's agent that just had a turn: its next one may come any moment
            main = GenerationRequest("main", prompt("hello. "), 2, agent_class=AgentClass.MAIN)
            timeline.submit(engine, main)
            timeline.wait("main")
        start = len(passes)
        sub = GenerationRequest("sub", prompt("a long file the subagent reads. ", 8), 1,
                                agent_class=AgentClass.SUBAGENT)
        timeline.submit(engine, sub)
        timeline.wait("sub")
        widths = [n for _, n in passes[start:]]
        if main_was_here:
            assert len(widths) > 2 and max(widths[1:]) <= MIN_CHUNK, widths
            assert paced_for.count(True) >= len(widths) - 1, (paced_for, widths)  # their own target: expected_gap_s
        else:  # nobody more urgent about: whole chunks
            assert max(widths) == 96, widths
        assert timeline.tokens("sub") == expected(engine, sub)


def test_with_work_running_admission_yields_to_the_batch_after_about_one_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    admitted: list[int] = []
    real = Admission.admit

    def counting(self, within_s=None):
        sequences = real(self, within_s)
        if sequences:
            admitted.append(len(sequences))
        return sequences

    slow = TurnCaches.prepare

    def slow_prepare(self, turn, running):  # a prefix copied or a cache read back: a few ms each
        time.sleep(0.005)
        return slow(self, turn, running)

    monkeypatch.setattr(Admission, "admit", counting)
    monkeypatch.setattr(TurnCaches, "prepare", slow_prepare)
    # A 1 ms step: every admission takes longer, so each pass admits one turn and the batch steps between.
    with running_engine(batch=6, prefill_step=64, decode_gap_ms=1.0) as engine:
        timeline = Timeline()
        talker = GenerationRequest("talker", prompt("talk: "), 48)
        timeline.submit(engine, talker)
        timeline.wait_until(lambda: len(timeline.tokens("talker")) >= 2, "the talker never decoded")
        release = held(engine)
        burst = [GenerationRequest(f"sub-{i}", prompt(f"subagent {i} reads a file. ", 4), 3,
                                   agent_class=AgentClass.SUBAGENT) for i in range(4)]
        for request in burst:
            timeline.submit(engine, request)
        release.set()
        for request in burst:
            timeline.wait(request.agent_id)
            assert timeline.tokens(request.agent_id) == expected(engine, request)
        assert admitted[1:] == [1, 1, 1, 1], admitted


def test_the_operator_raises_a_waiting_agent_ahead_and_metrics_are_per_class() -> None:
    with running_engine(batch=1) as engine:
        timeline = Timeline()
        release = held(engine)
        early = GenerationRequest("early", prompt("i came first. "), 6)
        late = GenerationRequest("late", prompt("i came second. "), 6, agent_class=AgentClass.BACKGROUND)
        timeline.submit(engine, early)
        timeline.submit(engine, late)
        engine.call(SetAgentPriority("late", 0))
        release.set()
        timeline.wait("early")
        timeline.wait("late")
        assert timeline.first("late", TokenEvent) < timeline.first("early", TokenEvent)
        classes = {c.name: c for c in engine.fresh_snapshot().throughput.classes}
        assert classes["background"].turns == 1 and classes["main"].turns == 1
        assert classes["main"].gap_max_s is not None and classes["main"].ttft_p50_s is not None
