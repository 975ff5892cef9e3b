"""Vision-language models served with images, on tiny random-weight Gemma 3, Qwen2-VL and Qwen2.5-VL built from
mlx-vlm's classes (every test runs on each: Qwen2-VL's image tokens take its grid's rows and columns as rotary
positions, and the text after an image goes on from the image's extent, M-RoPE).

A folder (bench/vision_model.py) is what a converted checkpoint is: mlx-vlm loads it whole,
semantic serves its language side through mlx-lm and its vision side through mlx-vlm. A reply to an image is
what plain mlx-vlm's greedy generation writes for the same prompt and image, through each protocol's
official SDK; the image is named by its bytes, so a later turn that sends it again reads it from the agent's
cache (through the warm tier and a restart too), and a second agent sending it computes no vision tower.
"""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

import anthropic
import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from engine.models.loaded import LoadedModel
from tests.model.engine_fixtures import load_folder
from tests.model.real_api import RealApi, running_api
from tests.support.family_engine import as_the_engine_reads

pytestmark = pytest.mark.model

MAX_TOKENS = 40  # above Claude Code's side-request size (identity.AUX_MAX_TOKENS): a main conversation
SETTINGS = dict(pool_budget_mb=64, max_output_tokens=64, persist_on_exit=True)


def picture(seed: int, width: int = 80, height: int = 60) -> bytes:
    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


SCREENSHOT, OTHER = picture(1), picture(2)


def image_block(data: bytes) -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                        "data": base64.b64encode(data).decode()}}


def data_url(data: bytes) -> str:
    return f"data:image/png;base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module", params=["gemma3", "qwen2_vl", "qwen2_5_vl", "qwen3_5", "qwen3_5_moe"])
def vlm_path(request: pytest.FixtureRequest, vlm_folders: Callable[[str], Path]) -> Path:
    return vlm_folders(request.param)


@pytest.fixture(scope="module")
def loaded(vlm_path: Path, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_folder(vlm_path, tmp_path_factory.mktemp("vlm-load"))


@pytest.fixture(scope="module")
def cache_dir(vlm_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp(f"{vlm_path.name}-cache")


@pytest.fixture(scope="module")
def api(loaded: LoadedModel, cache_dir: Path, vlm_path: Path) -> Iterator[RealApi]:
    with running_api(loaded, cache_dir, vlm_path, **SETTINGS) as served:
        yield served


@pytest.fixture(scope="module")
def reference(vlm_path: Path) -> "VlmReference":
    """Plain mlx-vlm: the model loaded whole, greedy generation on a prompt text and its images."""
    from mlx_vlm import load

    return VlmReference(*load(str(vlm_path)))


class VlmReference:
    def __init__(self, model: Any, processor: Any) -> None:
        self.model, self.processor = model, processor

    def __call__(self, messages: list[dict[str, Any]], images: list[bytes]) -> str:
        from mlx_vlm import generate

        # (mlx-vlm's detokenizer keeps a reply's leading blank where mlx-lm's, and so semantic's, leaves it out)
        return generate(self.model, self.processor, self._prompt(messages), image=_pictures(images) or None,
                        max_tokens=MAX_TOKENS, temperature=0.0, verbose=False).text.lstrip()

    def after(self, first: list[dict[str, Any]], images: list[bytes], messages: list[dict[str, Any]]) -> str:
        """The reply to ``messages``, which send ``first``'s reply back as text: read as the tokens the model wrote
        (the agent's cache holds them; the server reads them so: engine/runtime/scheduler/reply_splice.py)."""
        ids, written, _ = self._tokens(first, images)
        return self._tokens(messages, images, cached=(*ids, *written))[2]

    def _prompt(self, messages: list[dict[str, Any]]) -> str:
        return self.processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def _tokens(self, messages: list[dict[str, Any]], images: list[bytes],
                cached: tuple[int, ...] = ()) -> tuple[tuple[int, ...], tuple[int, ...], str]:
        """mlx-vlm's inputs for ``messages`` (their token ids taking ``cached``'s reply tokens where the text reads
        the same), the tokens it writes, and its text."""
        import mlx.core as mx
        from mlx_vlm import prepare_inputs, stream_generate
        from mlx_vlm.utils import should_add_special_tokens

        model, processor = self.model, self.processor
        inputs = prepare_inputs(processor, images=_pictures(images) or None, prompts=self._prompt(messages),
                                image_token_index=getattr(model.config, "image_token_index", None),
                                add_special_tokens=should_add_special_tokens(model.config.model_type, processor))
        ids = as_the_engine_reads(cached, [int(t) for t in inputs["input_ids"][0].tolist()], processor.tokenizer.decode)
        extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
        given = inputs.get("attention_mask")
        mask = None if given is None else mx.ones((1, len(ids)), dtype=given.dtype)
        written, text = [], ""
        for step in stream_generate(model, processor, "", input_ids=mx.array([ids]),
                                    pixel_values=inputs.get("pixel_values"), mask=mask, max_tokens=MAX_TOKENS,
                                    temperature=0.0, **extra):
            written.append(int(step.token))
            text += step.text
        return ids, tuple(written), text.lstrip()


def _pictures(images: list[bytes]) -> list[Image.Image]:
    return [Image.open(io.BytesIO(data)).convert("RGB") for data in images]


def claude(api: RealApi) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=api.url, api_key="unused")


def ask(api: RealApi, session: str, messages: list[dict[str, Any]]) -> anthropic.types.Message:
    return claude(api).messages.create(model="tiny-vlm", max_tokens=MAX_TOKENS, messages=messages,
                                       extra_body={"temperature": 0}, extra_headers={"X-Claude-Code-Session-Id": session})


def agent_of(api: RealApi, session: str) -> str:
    (agent,) = [a.agent_id for a in api.engine.fresh_snapshot().agents if session in a.agent_id]
    return agent


def vision(api: RealApi) -> dict[str, Any]:
    return api.stats()["throughput"]["vision"]


def resume_short(api: RealApi) -> int:
    """How far short of a past prompt's end a later turn resumes: one token on a model with recurrent layers
    (Qwen3.5's gated-delta state is kept one token short of the prompt's end, where a resent prompt needs it),
    none where every layer is attention."""
    return 1 if api.engine.loaded.spec.recurrent_groups else 0


def text_of(message: anthropic.types.Message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


DESCRIBE = [{"role": "user", "content": [image_block(SCREENSHOT), {"type": "text", "text": "What is on screen?"}]}]
DESCRIBE_TEMPLATE = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is on screen?"}]}]


def test_a_reply_to_an_image_is_what_mlx_vlm_writes_through_every_protocol(api: RealApi, reference) -> None:
    expected = reference(DESCRIBE_TEMPLATE, [SCREENSHOT])
    message = ask(api, "describe", DESCRIBE)
    assert text_of(message) == expected and message.usage.output_tokens == MAX_TOKENS

    client = openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused")
    chat = client.chat.completions.create(model="tiny-vlm", max_tokens=MAX_TOKENS, temperature=0, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(SCREENSHOT)}},
                                     {"type": "text", "text": "What is on screen?"}]}])
    assert chat.choices[0].message.content == expected
    response = client.responses.create(model="tiny-vlm", max_output_tokens=MAX_TOKENS, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": data_url(SCREENSHOT), "detail": "auto"},
                                     {"type": "input_text", "text": "What is on screen?"}]}])
    assert response.output_text == expected


def test_a_second_turn_resending_the_image_reads_it_from_the_cache(api: RealApi) -> None:
    first = ask(api, "two-turns", DESCRIBE)
    encoded = vision(api)["images_encoded"]
    second = ask(api, "two-turns", [*DESCRIBE, {"role": "assistant", "content": text_of(first)},
                                       {"role": "user", "content": "And the colours?"}])
    # The whole first prompt, image included, comes from the cache; the tower does not run again.
    prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens >= prompt - resume_short(api)
    assert vision(api)["images_encoded"] == encoded


def test_a_turn_after_two_images_of_other_shapes_is_what_mlx_vlm_writes(api: RealApi, reference) -> None:
    """Two pictures of other aspect ratios (on Qwen2-VL runs of 3x2 and 2x3 tokens, each moving the positions of
    what follows), then a second turn read from the cache: its prompt past the images and its reply rotate at the
    positions mlx-vlm gives the whole conversation.

    mlx-vlm runs the two pictures through the tower as one batch, semantic one at a time (each is kept by its own
    key), and the last bits of the features differ (3.7e-7). (Gemma 3 once turned that into another first token:
    its projector started at ones, every hidden unit of an image the same near-zero sum; bench/vision_model.py
    now starts it random, as a checkpoint's is.)
    """
    wide, tall = picture(21, 84, 56), picture(22, 56, 84)
    turn1 = [{"role": "user", "content": [image_block(wide), {"type": "text", "text": "Compare"},
                                          image_block(tall), {"type": "text", "text": "these two."}]}]
    first = ask(api, "two-shapes", turn1)
    template1 = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Compare"},
                                              {"type": "image"}, {"type": "text", "text": "these two."}]}]
    assert text_of(first) == reference(template1, [wide, tall])
    follow = [{"role": "assistant", "content": text_of(first)}, {"role": "user", "content": "Which is wider?"}]
    second = ask(api, "two-shapes", [*turn1, *follow])
    assert second.usage.cache_read_input_tokens >= (first.usage.input_tokens + first.usage.cache_read_input_tokens
                                                    - resume_short(api))
    assert text_of(second) == reference.after(template1, [wide, tall], [*template1, *follow])


def test_agents_in_one_batch_each_rotate_at_their_own_positions(api: RealApi, reference) -> None:
    """Three agents at once (pictures of two shapes and a text-only one) share prefill passes and decode steps; each
    reply is what mlx-vlm writes for that agent alone (on Qwen2-VL each row of a step rotates by its own shift)."""
    asks = {"wide": picture(31, 84, 56), "tall": picture(32, 56, 84), "text": None}

    def one(name: str) -> str:
        content: list[dict[str, Any]] = [{"type": "text", "text": f"Agent {name} asks: what is this?"}]
        if asks[name] is not None:
            content.insert(0, image_block(asks[name]))
        return text_of(ask(api, f"batch-{name}", [{"role": "user", "content": content}]))

    with ThreadPoolExecutor(len(asks)) as pool:
        replies = dict(zip(asks, pool.map(one, asks)))
    for name, data in asks.items():
        parts = [{"type": "text", "text": f"Agent {name} asks: what is this?"}]
        if data is not None:
            parts.insert(0, {"type": "image"})
        assert replies[name] == reference([{"role": "user", "content": parts}], [data] if data else []), name


def test_another_image_in_its_place_is_not_served_from_the_cache(api: RealApi) -> None:
    first = ask(api, "swapped", DESCRIBE)
    swapped = [{"role": "user", "content": [image_block(OTHER), {"type": "text", "text": "What is on screen?"}]}]
    second = ask(api, "swapped", swapped)
    # Only the tokens before the image match: the template's opening (a few tokens), never the image's run.
    assert second.usage.cache_read_input_tokens < 8
    assert text_of(second) != text_of(first) or second.usage.input_tokens > 8


def test_two_agents_sending_one_image_run_the_vision_tower_once(api: RealApi) -> None:
    shared = picture(7)
    before = vision(api)
    for session in ("agent-a", "agent-b"):
        ask(api, session, [{"role": "user", "content": [{"type": "text", "text": f"I am {session}."},
                                                        image_block(shared)]}])
    after = vision(api)
    assert after["images_encoded"] == before["images_encoded"] + 1
    assert after["images_reused"] >= before["images_reused"] + 1


def test_an_image_a_tool_returns_reaches_the_model(api: RealApi, reference) -> None:
    """Claude Code's Read tool returns a picture as an image block inside the tool_result."""
    read = {"name": "Read", "description": "Read a file", "input_schema": {
        "type": "object", "properties": {"file_path": {"type": "string"}}, "required": ["file_path"]}}
    messages = [
        {"role": "user", "content": "Look at shot.png"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read",
                                           "input": {"file_path": "/tmp/shot.png"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [image_block(picture(11))]}]}]
    before = vision(api)["images_encoded"]
    message = claude(api).messages.create(model="tiny-vlm", max_tokens=MAX_TOKENS, messages=messages, tools=[read],
                                          extra_body={"temperature": 0})
    assert vision(api)["images_encoded"] == before + 1
    # SmolLM2's template has no tool support: the result is a <tool_response> user turn, the image inside it.
    from engine.formats.rendering import FALLBACK_TOOL_PROMPT, dumps

    tools = FALLBACK_TOOL_PROMPT.format(tools=dumps({"type": "function", "function": {
        "name": "Read", "description": "Read a file", "parameters": read["input_schema"]}}))
    call = dumps({"name": "Read", "arguments": {"file_path": "/tmp/shot.png"}})
    template = [{"role": "system", "content": tools},
                {"role": "user", "content": "Look at shot.png"},
                {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
                {"role": "user", "content": [{"type": "text", "text": "<tool_response>\n"}, {"type": "image"},
                                             {"type": "text", "text": "\n</tool_response>"}]}]
    assert text_of(message) == reference(template, [picture(11)])


def test_the_image_comes_back_from_the_warm_tier_and_after_a_restart(
        loaded: LoadedModel, vlm_path: Path, tmp_path: Path) -> None:
    history = [*DESCRIBE]
    with running_api(loaded, tmp_path, vlm_path, **SETTINGS) as served:
        first = ask(served, "kept", history)
        agent = agent_of(served, "kept")
        history += [{"role": "assistant", "content": text_of(first)}, {"role": "user", "content": "More?"}]
        response = httpx.post(f"{served.url}/v1/agents/{agent}/evict", json={"tier": "warm"}, timeout=60)
        assert response.status_code == 200, response.text
        second = ask(served, "kept", history)
        assert second.usage.cache_read_input_tokens >= first.usage.input_tokens - resume_short(served)
        history += [{"role": "assistant", "content": text_of(second)}, {"role": "user", "content": "Anything else?"}]
    with running_api(loaded, tmp_path, vlm_path, **SETTINGS) as restarted:
        third = ask(restarted, "kept", history)
        assert third.usage.cache_read_input_tokens >= (second.usage.input_tokens + second.usage.cache_read_input_tokens
                                                       - resume_short(restarted))
        # Read from disk: no image went through the vision tower in the new engine.
        assert vision(restarted) == {"images_encoded": 0, "images_reused": 0, "vision_s": 0.0}


def test_the_direct_agent_api_keeps_an_image_in_the_agents_history(api: RealApi, reference) -> None:
    with httpx.Client(base_url=api.url, timeout=120) as http:
        assert http.post("/v1/agents", json={"agent_id": "looker"}).status_code in (200, 201)
        first = http.post("/v1/agents/looker/messages", json={
            "content": "What is on screen?", "images": [data_url(SCREENSHOT)], "max_tokens": MAX_TOKENS,
            "temperature": 0}).json()
        assert first["content"] == reference(DESCRIBE_TEMPLATE, [SCREENSHOT])
        second = http.post("/v1/agents/looker/messages", json={"content": "And the colours?",
                                                               "max_tokens": MAX_TOKENS, "temperature": 0}).json()
        # The stored history holds the image: the second turn renders it again and reads it from the cache.
        assert second["usage"]["reused_tokens"] >= first["usage"]["prompt_tokens"] - resume_short(api)
        bad = http.post("/v1/agents/looker/messages", json={"content": "x", "images": ["data:image/png;base64,iVBOR"]})
        assert bad.status_code == 400 and "images.0" in bad.text


def test_the_cpu_backends_tower_paths_give_the_towers_own_features(loaded: LoadedModel, monkeypatch) -> None:
    """The CPU backend's vision pass (its host attention and activations, backends/cpu/backend.py) on this
    family's real tower: with the paths' size thresholds lowered so the tiny tower takes them, an image's
    features equal the tower's own (MLX's kernels) to float32 rounding, and each path was taken."""
    from engine.runtime.runner.backends.cpu import backend as cpu_backend, cpu_math, host_softmax
    from engine.runtime.runner.backends.cpu.backend import CpuBackend

    calls = {"attention": 0, "activation": 0}
    host_sdpa = cpu_backend.HOST_ATTENTION.sdpa

    def attention(*args: Any) -> Any:
        calls["attention"] += 1
        return host_sdpa(*args)

    def counted(fast: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def activation(x: Any) -> Any:
            calls["activation"] += 1
            return fast(x)
        return activation

    host_softmax.warm_up()
    monkeypatch.setattr(cpu_backend, "HOST_ATTENTION", type("Counted", (), {"sdpa": staticmethod(attention)})())
    # Gemma 3's and Qwen3.5's towers take the tanh GELU, Qwen2-VL's the sigmoid one, Qwen2.5-VL's SiLU.
    for name in ("gelu_approx", "gelu_fast_approx", "silu"):
        monkeypatch.setattr(cpu_math, name, counted(getattr(cpu_math, name)))
    monkeypatch.setattr(cpu_math, "MIN_ELEMENTS", 16)
    monkeypatch.setattr(cpu_math, "MAX_SCORES", 64)  # past it: the compiled softmax rows
    vision = loaded.vision
    marker_prompt = f"<|im_start|>user\n{vision.marker}What is this?<|im_end|>\n"
    inputs = vision.prepare(marker_prompt, [Image.open(io.BytesIO(picture(9, 112, 84))).convert("RGB")])
    length = int((inputs.pop("input_ids")[0] == vision.image_token_id).sum())
    inputs.pop("attention_mask", None)
    plain = vision.embeddings(inputs, length)
    backend = CpuBackend()
    backend.attach(loaded.model)
    try:
        with backend.vision_pass():
            fast = vision.embeddings(inputs, length)
    finally:
        backend.detach(loaded.model)
        backend.close()
    assert calls["attention"] > 0
    assert calls["activation"] > 0, calls
    difference = float(np.abs(np.array(fast) - np.array(plain)).max())
    assert np.allclose(np.array(fast), np.array(plain), rtol=1e-4, atol=1e-5), difference
