"""Which resident model serves a request (engine/models/model_slots.py), and the device's turns between them."""

from __future__ import annotations

import threading
import time

import pytest

from engine.domain.model_slots import ModelRoutes, ModelSlot, ModelSlotError, model_slots, parse_model_slot
from engine.runtime.engine_thread.device_turns import DeviceTurns


def test_a_slot_parses_with_its_options_and_a_bad_one_names_what_is_wrong() -> None:
    slot = parse_model_slot("small=smollm2-135m,side,pinned,idle=600,pool=256")
    assert slot == ModelSlot("small", "smollm2-135m", pinned=True, role="side", idle_unload_s=600.0, pool_mb=256.0)
    assert parse_model_slot(" coder = /models/Qwen3-Coder ").names() == ("coder", "/models/Qwen3-Coder", "Qwen3-Coder")
    for bad, says in [("smollm2-135m", "ALIAS=SOURCE"), ("=x", "ALIAS=SOURCE"), ("a=b,fast", "option 'fast'"),
                      ("a=b,idle=-1", "positive"), ("a=b,pool=lots", "option 'pool=lots'")]:
        with pytest.raises(ModelSlotError, match=says) as caught:
            parse_model_slot(bad)
        assert caught.value.field == "extra_models"
    with pytest.raises(ModelSlotError, match="used twice"):
        model_slots("main", ("a=x", "A=y"))
    with pytest.raises(ModelSlotError, match="only one model may be the side model"):
        model_slots("main", ("a=x,side", "b=y,side"))


def test_requests_route_by_name_then_pattern_then_the_side_tier_then_the_default() -> None:
    slots = model_slots("/models/big-coder", ("small=smollm2-135m,side", "gemma=gemma3-270m"))
    routes = ModelRoutes.of(slots, ("gpt-5*=gemma",))
    routes.model_ids["gemma"] = "gemma-3-270m-it"
    alias = lambda name, auxiliary=False: routes.route(name, auxiliary)[0].alias  # noqa: E731
    assert alias("small") == alias("SMALL") == "small"
    assert alias("big-coder") == alias("/models/big-coder") == "/models/big-coder"
    assert alias("gemma-3-270m-it") == "gemma"  # the id its weights carry, once loaded
    assert routes.route("gpt-5-codex")[1] == "pattern gpt-5*"
    assert alias("gpt-5-codex") == "gemma"
    assert alias("claude-haiku-4-5-20251001") == alias("claude-3-5-haiku-latest") == "small"
    assert alias("claude-opus-4-8") == alias("claude-sonnet-4-6") == alias("who-knows") == alias(None) == "/models/big-coder"
    assert routes.route("claude-opus-4-8", auxiliary=True) == (routes.slot("small"), "side request")
    # Without a side model, the haiku tier is the default model's.
    plain = ModelRoutes.of(model_slots("main", ("other=x",)), ())
    assert plain.route("claude-haiku-4-5")[0].alias == "main"
    with pytest.raises(ModelSlotError, match="ALIAS one of main, other"):
        ModelRoutes.of(plain.slots, ("gpt*=nobody",))


def test_two_engines_with_steps_of_one_length_take_turns_on_the_device() -> None:
    turns = DeviceTurns()
    order: list[str] = []
    start = threading.Barrier(2)

    def steps(name: str) -> None:
        start.wait()
        for _ in range(20):
            with turns.turn(name):
                order.append(name)
                time.sleep(0.005)  # a step's work, on the device

    threads = [threading.Thread(target=steps, args=(name,)) for name in ("big", "small")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # Equal shares of time: neither runs more than a few steps in a row while the other waits (steps of one
    # length differ by the sleep's jitter, so two in a row happen).
    middle = "".join("b" if name == "big" else "s" for name in order[4:-4])
    assert "bbbbb" not in middle and "sssss" not in middle, order
    assert turns.turns == {"big": 20, "small": 20} and turns.waited_s["small"] > 0


def test_turns_share_the_devices_time_so_short_steps_go_on_beside_long_ones() -> None:
    turns = DeviceTurns()
    steps = {"prefill": 0, "decode": 0}
    stop = threading.Event()
    start = threading.Barrier(2)

    def run(name: str, step_s: float) -> None:
        start.wait()
        while not stop.is_set():
            with turns.turn(name):
                steps[name] += 1
                time.sleep(step_s)

    threads = [threading.Thread(target=run, args=("prefill", 0.1)), threading.Thread(target=run, args=("decode", 0.005))]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    stop.set()
    for thread in threads:
        thread.join()
    # By time: each had about half the device; by steps the decoder would have had one step per prefill step.
    share = turns.held_s["decode"] / (turns.held_s["decode"] + turns.held_s["prefill"])
    assert 0.3 < share < 0.7, turns.held_s
    assert steps["decode"] > 5 * steps["prefill"], steps


def test_an_engine_back_from_idle_gets_no_credit_for_its_idle_time() -> None:
    turns = DeviceTurns()
    with turns.turn("busy"):
        time.sleep(0.05)
    with turns.turn("busy"):
        time.sleep(0.05)
    with turns.turn("idle"):  # it had used nothing; it starts at the clock of the last turn, not at zero
        pass
    assert turns._used["idle"] >= 0.05


def test_an_engine_is_contended_while_another_waits_or_has_just_stepped() -> None:
    turns = DeviceTurns()
    assert not turns.contended("big")
    with turns.turn("small"):
        pass
    assert turns.contended("big") and not turns.contended("small")  # small just stepped: it will again
    time.sleep(0.02)
    assert not turns.contended("big")  # it went idle
    holding, asked = threading.Event(), threading.Event()

    def other() -> None:
        asked.set()
        with turns.turn("small"):
            pass

    with turns.turn("big"):
        thread = threading.Thread(target=other)
        thread.start()
        asked.wait()
        time.sleep(0.01)
        assert turns.contended("big")  # small waits for the device
    thread.join()
