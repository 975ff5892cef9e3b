"""The reasoning tracker: every token's route, markers hidden, budgets exact, harmony's headers read."""

from __future__ import annotations

import pytest

from engine.domain.reasoning import ANSWER, REASONING, Channel, HarmonyFormat, Route, ThinkFormat, TokenRule
from engine.domain.reasoning_tracker import HarmonyTracker, ThinkTracker, start_tracker
from engine.models.reasoning_format import reasoning_format
from tests.support.marker_tokenizer import HARMONY, MarkerTokenizer

pytestmark = pytest.mark.unit

TOK = MarkerTokenizer()
START, END = TOK.special_ids["<think>"], TOK.special_ids["</think>"]
FMT = reasoning_format(TOK)


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


def feed_all(tracker, tokens: list[int]) -> list[tuple[int, Route]]:
    out = []
    for t in tokens:
        out += tracker.feed(t)
    return out + tracker.flush()


def texts(routed: list[tuple[int, Route]]) -> dict[Channel, str]:
    out: dict[Channel, list[int]] = {}
    for token, route in routed:
        out.setdefault(route.channel, []).append(token)
    return {channel: TOK.decode(tokens) for channel, tokens in out.items()}


def test_the_tokenizers_think_markers_are_the_format() -> None:
    assert FMT == ThinkFormat((START,), (END,), "<think>", "</think>")


def test_a_prompt_that_opened_the_reasoning_starts_in_it_and_the_end_marker_is_hidden() -> None:
    tracker = ThinkTracker(FMT, ids("<user>hi\n<assistant><think>"))
    routed = feed_all(tracker, ids("plan it</think>Hello."))
    assert texts(routed) == {Channel.REASONING: "plan it", Channel.ANSWER: "Hello."}
    assert tracker.reasoning_tokens == len("plan it")
    assert END not in [t for t, _ in routed]


def test_a_model_that_opens_its_reasoning_itself_is_split_the_same() -> None:
    tracker = ThinkTracker(FMT, ids("<user>hi\n<assistant>"))
    assert tracker.route is ANSWER
    assert texts(feed_all(tracker, ids("<think>a</think>b<think>c</think>d"))) == {
        Channel.REASONING: "ac", Channel.ANSWER: "bd"}


def test_a_marker_of_several_tokens_is_held_until_it_is_whole_or_cannot_be() -> None:
    """Gemma 4's start marker is two tokens (<|channel> then "thought"): the first alone is text after all."""
    fmt = ThinkFormat((300, 301), (302,), "<|channel>thought", "<channel|>")
    tracker = ThinkTracker(fmt, [1, 2])
    assert tracker.feed(300) == []  # held: it may be the marker's start
    assert tracker.feed(7) == [(300, ANSWER), (7, ANSWER)]  # it was not
    assert tracker.feed(300) == [] and tracker.feed(301) == []  # the whole marker: hidden
    assert tracker.route is REASONING
    assert tracker.feed(9) == [(9, REASONING)]
    assert tracker.feed(302) == [] and tracker.route is ANSWER
    tracker.feed(300)
    assert tracker.flush() == [(300, ANSWER)]  # held at the end: text


def test_a_budget_forces_the_end_marker_after_exactly_that_many_reasoning_tokens() -> None:
    tracker = ThinkTracker(FMT, ids("<assistant><think>"), budget=3)
    assert not tracker.may_rule(1)
    tracker.feed(ids("a")[0])
    assert tracker.may_rule(1) is False and tracker.rule() is None
    tracker.feed(ids("b")[0])
    assert tracker.may_rule(1)  # the token in flight may be the last one the budget allows
    assert tracker.rule() is None
    tracker.feed(ids("c")[0])
    assert tracker.rule() == TokenRule(force=END)
    assert tracker.feed(END) == [] and tracker.route is ANSWER
    # Spent: the answer follows, and the reasoning cannot be opened again in this turn.
    assert tracker.rule() == TokenRule(forbid=(START,))
    assert tracker.reasoning_tokens == 3
    assert tracker.draft_room(100) == 0


def test_a_budget_of_zero_closes_an_opened_reasoning_at_once() -> None:
    tracker = ThinkTracker(FMT, ids("<assistant><think>"), budget=0)
    assert tracker.rule() == TokenRule(force=END)


def test_no_budget_never_rules_and_leaves_drafts_free() -> None:
    tracker = ThinkTracker(FMT, ids("<assistant><think>"))
    for t in ids("x" * 50):
        tracker.feed(t)
    assert tracker.rule() is None and not tracker.may_rule(1) and tracker.draft_room(100) == 100


def test_drafts_stop_short_of_the_budget() -> None:
    tracker = ThinkTracker(FMT, ids("<assistant><think>"), budget=10)
    for t in ids("abcd"):
        tracker.feed(t)
    assert tracker.draft_room(100) == 5  # the next token and 5 drafts: 10 reasoning tokens at most


def test_a_template_that_closed_the_reasoning_leaves_no_opening() -> None:
    tracker = ThinkTracker(FMT, ids("<assistant><think></think>"), constrained=True)
    assert tracker.route is ANSWER and tracker.opening_token is None
    opened = ThinkTracker(FMT, ids("<assistant>"), constrained=True)
    assert opened.opening_token == START  # a grammar may let the model open its reasoning first
    opened.feed(START)
    assert opened.route is REASONING and opened.opening_token is None


# -- harmony --------------------------------------------------------------------------------------
HTOK = MarkerTokenizer(HARMONY, stop=("<|call|>", "<|return|>"))
HFMT = reasoning_format(HTOK)


def hids(text: str) -> list[int]:
    return HTOK.encode(text, add_special_tokens=False)


def htexts(routed: list[tuple[int, Route]]) -> dict[object, str]:
    out: dict[object, list[int]] = {}
    for token, route in routed:
        key = route.channel if route.channel is not Channel.CALL else (route.call, route.name)
        out.setdefault(key, []).append(token)
    return {key: HTOK.decode(tokens) for key, tokens in out.items()}


def test_harmony_is_found_by_its_special_tokens() -> None:
    assert isinstance(HFMT, HarmonyFormat)
    assert HFMT.assistant == tuple(hids("assistant")) and HFMT.analysis == tuple(hids("analysis"))


def test_harmony_channels_route_analysis_final_and_calls_and_hide_headers() -> None:
    tracker = start_tracker(HFMT, hids("<|start|>user<|message|>hi<|end|><|start|>assistant"), HTOK.decode)
    assert isinstance(tracker, HarmonyTracker) and tracker.state == HarmonyTracker.HEADER
    written = ("<|channel|>analysis<|message|>Need weather.<|end|>"
               "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
               "<|message|>{\"city\": \"Oslo\"}<|call|>")
    routed = []
    for t in hids(written):
        routed += tracker.feed(t)
    assert htexts(routed) == {Channel.REASONING: "Need weather.", (0, "get_weather"): '{"city": "Oslo"}'}
    final = start_tracker(HFMT, hids("<|start|>assistant"), HTOK.decode)
    routed = []
    for t in hids("<|channel|>final<|message|>Sunny.<|return|>"):
        routed += final.feed(t)
    assert htexts(routed) == {Channel.ANSWER: "Sunny."}


def test_a_harmony_budget_ends_the_analysis_and_keeps_it_closed() -> None:
    tracker = start_tracker(HFMT, hids("<|start|>assistant"), HTOK.decode, budget=2)
    for t in hids("<|channel|>analysis<|message|>ab"):
        tracker.feed(t)
    forced = []
    while (rule := tracker.rule()) is not None and rule.force is not None:
        forced.append(rule.force)
        tracker.feed(rule.force)
    assert HTOK.decode(forced) == "<|end|><|start|>assistant<|channel|>"
    assert tracker.rule() == TokenRule(forbid=(HFMT.analysis[0],))  # any channel but analysis
    for t in hids("final<|message|>x"):
        tracker.feed(t)
    assert tracker.reasoning_tokens == 2 and tracker.answering
