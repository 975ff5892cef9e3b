"""Several models resident under one budget, each request served by the model it names (--extra-model).

Three tiny random-weight models of different families (Gemma 4 as the
default, DeepSeek V3's latent-attention MoE as the side model, the Qwen3.5
gated-delta hybrid), saved as model folders with SmolLM2's tokenizer, served
by the real app the way ``semantic --serve --extra-model ...`` serves them.
Requests go to a model by alias, folder name, pattern, Claude Code's haiku
tier and by default; every reply is what plain mlx-lm's greedy decoding of
that model says; a budget that holds two of the three unloads the least
recently used extra model (its agents to disk, back with it); a pinned one
is never unloaded; a model that cannot fit is a 503 that says what is resident.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from engine.api.app import create_app
from engine.formats.rendering import PromptRenderer
from engine.api.service import EngineService
from engine.api.turns import MODEL_HEADER
from engine.bootstrap import start_engine
from engine.domain.chat import ChatMessage, Conversation
from engine.settings import Settings
from tests.model.engine_fixtures import load_folder
from tests.support.reference import reference_greedy
from tests.support.router_app import LiveServer
from tests.support.tiny_models import family_config, recurrent_family_config, vary

from bench.random_model import write_model_folder

pytestmark = pytest.mark.model

REPLY = 12
POOL_MB = 16  # each model's KV pool; the budgets below are counted in these


@pytest.fixture(scope="module")
def folders(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    vocab = len(PromptRenderer(load_folder(smollm2_path, tmp_path_factory.mktemp("tok")).tokenizer).tokenizer.vocab)
    configs = {"gemma4": family_config("gemma4_text", vocab), "deepseek": family_config("deepseek_v3", vocab),
               "qwen35": recurrent_family_config("qwen3_5", vocab)}
    return {name: write_model_folder(config, tmp_path_factory.mktemp(name) / f"{name}-tiny", smollm2_path, "float32",
                                     seed=0, transform=vary)
            for name, config in configs.items()}


@pytest.fixture(scope="module")
def references(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """Each model loaded alone, for plain mlx-lm's greedy reference."""
    return {name: load_folder(folder, tmp_path_factory.mktemp(f"{name}-ref")) for name, folder in folders.items()}


@contextlib.contextmanager
def serving(default: Path, cache_dir: Path, extra: tuple[str, ...], **settings) -> Iterator[tuple[str, EngineService]]:
    config = Settings(cache_dir=cache_dir, model=str(default), extra_models=extra,
                      **{"pool_budget_mb": POOL_MB, "max_batch_size": 8, "api_key": None, "swap_grace_s": 0.0,
                         **settings})
    engine = start_engine(config)
    service = EngineService(config, engine)
    service.serve_extra_models(engine)
    try:
        with LiveServer(create_app(service)) as server:
            yield server.url, service
    finally:
        if service.models is not None:
            service.models.stop_all()
        engine.stop(0.0)


def budget_for_two(folders: dict[str, Path]) -> float:
    """MiB that hold the default model and either extra one (weights and pool), never both extras."""
    weights = {name: (folder / "model.safetensors").stat().st_size for name, folder in folders.items()}
    pool = POOL_MB * 2**20
    held = weights["gemma4"] + pool + max(weights["deepseek"], weights["qwen35"]) + pool
    return (held + min(pool, min(weights["deepseek"], weights["qwen35"]) + pool) // 2) / 2**20


def expected(loaded, messages: list[dict[str, str]]) -> str:
    prompt = PromptRenderer(loaded.tokenizer).render(
        Conversation(tuple(ChatMessage(m["role"], m["content"]) for m in messages)))
    eos = set(loaded.eos_token_ids)
    detokenizer = loaded.tokenizer.detokenizer
    detokenizer.reset()
    for token in (t for t in reference_greedy(loaded.model, list(prompt), REPLY, eos) if t not in eos):
        detokenizer.add_token(token)
    detokenizer.finalize()
    return detokenizer.text


def chat(url: str, model: str, session: str, messages: list[dict[str, str]]) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": model, "messages": messages, "max_tokens": REPLY, "temperature": 0, "session_id": session})


def message(url: str, model: str, session: str, text: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/messages", timeout=120, headers={"anthropic-version": "2023-06-01",
                                                                    "x-claude-code-session-id": session},
                      json={"model": model, "max_tokens": REPLY, "temperature": 0,
                            "messages": [{"role": "user", "content": text}]})


def models_listing(url: str) -> dict[str, dict]:
    return {m["id"]: m for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}


def test_each_request_is_served_by_the_model_it_names_token_for_token(folders, references, tmp_path: Path) -> None:
    extra = (f"deep={folders['deepseek']},side", f"qwen={folders['qwen35']}")
    messages = [{"role": "user", "content": "Name a sorting algorithm."}]
    with serving(folders["gemma4"], tmp_path / "cache", extra) as (url, service):
        identity = {name: loaded.identity.key for name, loaded in references.items()}
        cases = [  # (model field, which model serves it)
            ("deep", "deepseek"),                      # an alias
            ("qwen35-tiny", "qwen35"),                 # its folder's name
            ("claude-haiku-4-5-20251001", "deepseek"),  # Claude Code's haiku tier: the side model
            ("claude-opus-4-8", "gemma4"),              # any other Claude name: the default
            ("no-such-model", "gemma4"),                # unknown names: the default, never a 404
            (str(folders["qwen35"]), "qwen35"),         # its source as configured
        ]
        for index, (model, served_by) in enumerate(cases):
            reply = chat(url, model, f"route-{index}", messages)
            assert reply.status_code == 200, reply.text
            assert reply.headers[MODEL_HEADER] == identity[served_by], model
            assert reply.json()["choices"][0]["message"]["content"] == expected(references[served_by], messages), model
        # The Anthropic endpoint routes alike, and names the model the client asked for in its reply.
        reply = message(url, "claude-3-5-haiku-latest", "cc-session", "Name a sorting algorithm.")
        assert reply.status_code == 200, reply.text
        assert reply.headers[MODEL_HEADER] == identity["deepseek"]
        assert reply.json()["model"] == "claude-3-5-haiku-latest"

        listing = models_listing(url)
        assert {listing[a]["state"] for a in ("deep", "qwen")} == {"resident"}
        assert listing["deep"]["role"] == "side" and listing[str(folders["gemma4"])]["default"] is True
        assert listing["qwen"]["requests_routed"] == 2
        stats = httpx.get(f"{url}/v1/stats", timeout=30).json()
        rows = {row["alias"]: row for row in stats["models"]}
        # Each model's pool is its own, and what it holds is counted there; the budget sums them all.
        pools = {slot.alias: engine.pool.total_bytes for slot, engine in service.models.engines()}
        for alias, row in rows.items():
            assert row["pool_bytes"] == pools[alias] and 0.9 < row["pool_bytes"] / (POOL_MB * 2**20) < 1.1
            assert row["weights_bytes"] > 0
            assert 0 < row["kv_used_bytes"] <= row["pool_bytes"]
        assert stats["models_budget"]["held_bytes"] == sum(r["pool_bytes"] + r["weights_bytes"] for r in rows.values())

        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        assert 'semantic_model_resident{model="deep",role="side"} 1.0' in metrics
        assert 'semantic_model_requests_routed_total{model="qwen"} 2.0' in metrics
        default_routed = [line for line in metrics.splitlines()
                          if line.startswith("semantic_model_requests_routed_total") and "gemma4-tiny" in line]
        assert default_routed and default_routed[0].endswith(" 2.0")  # claude-opus-4-8 and no-such-model

        # Agents belong to a model: listed under it, and acted on there.
        agents = httpx.get(f"{url}/v1/agents", timeout=30).json()["data"]
        by_model = {(a["agent_id"], a["model"]) for a in agents}
        assert {("oa-route-0", "deep"), ("oa-route-1", "qwen"), ("oa-route-3", str(folders["gemma4"]))} <= by_model
        evicted = httpx.post(f"{url}/v1/agents/oa-route-0/evict?model=deep", json={"tier": "warm"}, timeout=60)
        assert evicted.status_code == 200, evicted.text
        assert evicted.json()["model"] == "deep" and evicted.json()["tier"] == "warm"
        assert httpx.get(f"{url}/v1/agents/oa-route-0?model=qwen", timeout=30).status_code == 404
        again = chat(url, "deep", "route-0", messages)  # back from disk in its own model
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        # A fork stays within its model: it shares the agent's cache there.
        fork = httpx.post(f"{url}/v1/agents/oa-route-0/fork?model=deep", json={"name": "deep-fork"}, timeout=60)
        assert fork.status_code == 201, fork.text
        assert fork.json()["agent"]["model"] == "deep" and fork.json()["cached_tokens"] > 0
        assert ("deep-fork", "deep") in {(a["agent_id"], a["model"])
                                         for a in httpx.get(f"{url}/v1/agents", timeout=30).json()["data"]}
        # An export is of the model that holds the agent: the file names DeepSeek's weights.
        exported = httpx.get(f"{url}/v1/agents/oa-route-0/export?model=deep", timeout=60)
        assert exported.status_code == 200, exported.text
        assert int(exported.headers["x-semantic-tokens"]) > 0
        assert identity["deepseek"].split("@")[1].encode() in exported.content[:100_000]
        # An import goes back to the model whose weights made the file, without being told which.
        assert httpx.delete(f"{url}/v1/agents/oa-route-0?model=deep", timeout=60).status_code in (200, 204)
        imported = httpx.post(f"{url}/v1/agents/import", content=exported.content, timeout=60,
                              headers={"content-type": "application/octet-stream"})
        assert imported.status_code == 201, imported.text
        assert imported.json()["agent"]["model"] == "deep" and imported.json()["agent"]["tier"] == "warm"
        # ?model= names another one: that model refuses a file of other weights, naming both.
        foreign = httpx.post(f"{url}/v1/agents/import?model=qwen&as=deep-copy", content=exported.content, timeout=60,
                              headers={"content-type": "application/octet-stream"})
        assert foreign.status_code == 409 and "qwen" in foreign.text.lower(), foreign.text
        resumed = chat(url, "deep", "route-0", messages)
        assert resumed.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_a_budget_for_two_unloads_the_least_recently_used_and_its_agents_come_back(folders, references,
                                                                                    tmp_path: Path) -> None:
    extra = (f"deep={folders['deepseek']}", f"qwen={folders['qwen35']}")
    messages = [{"role": "user", "content": "Write a haiku about caches."}]
    with serving(folders["gemma4"], tmp_path / "cache", extra, models_budget_mb=budget_for_two(folders)) as (url, service):
        first = chat(url, "deep", "deep-agent", messages)
        assert first.status_code == 200, first.text
        reply = chat(url, "qwen", "qwen-agent", messages)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == expected(references["qwen35"], messages)
        listing = models_listing(url)
        assert listing["deep"]["state"] == "unloaded" and listing["qwen"]["state"] == "resident"
        # DeepSeek comes back (Qwen goes): its agent's cache was written to disk and is read back, not prefilled.
        again = chat(url, "deep", "deep-agent", messages)
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["message"]["content"] == first.json()["choices"][0]["message"]["content"]
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert models_listing(url)["qwen"]["state"] == "unloaded"
        events = [e.message for e in service.events.since(0)]
        assert any("model qwen unloaded (making room for deep)" in m for m in events), events
    # A restart: each model's agents are on disk, and come back when their model loads.
    with serving(folders["gemma4"], tmp_path / "cache", extra, models_budget_mb=budget_for_two(folders)) as (url, _):
        for model, session in (("qwen", "qwen-agent"), ("deep", "deep-agent")):
            reply = chat(url, model, session, messages)
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, model


def test_a_model_loading_holds_its_own_requests_and_no_one_elses(folders, tmp_path: Path) -> None:
    import threading

    extra = (f"qwen={folders['qwen35']}",)
    with serving(folders["gemma4"], tmp_path / "cache", extra) as (url, service):
        assert service.models is not None
        release, building = threading.Event(), threading.Event()
        build = service.models._build

        def held_build(slot):  # the load takes as long as the test says
            building.set()
            release.wait(60)
            return build(slot)

        service.models._build = held_build
        replies: list[httpx.Response] = []
        waiting = [threading.Thread(target=lambda i=i: replies.append(
            chat(url, "qwen", f"qwen-{i}", [{"role": "user", "content": "hi"}]))) for i in range(2)]
        for thread in waiting:
            thread.start()
        assert building.wait(30)
        assert models_listing(url)["qwen"]["state"] == "loading"
        # The default model answers while the other loads.
        assert chat(url, "other", "default-agent", [{"role": "user", "content": "hi"}]).status_code == 200
        assert not replies
        release.set()
        for thread in waiting:
            thread.join(60)
        assert [r.status_code for r in replies] == [200, 200]
        assert [row["loads"] for row in service.models.describe() if row["alias"] == "qwen"] == [1]


def test_a_pinned_model_is_never_unloaded_and_what_cannot_fit_says_why(folders, tmp_path: Path) -> None:
    extra = (f"deep={folders['deepseek']}", f"qwen={folders['qwen35']},pinned")
    with serving(folders["gemma4"], tmp_path / "cache", extra, models_budget_mb=budget_for_two(folders)) as (url, service):
        assert service.models is not None
        service.models.engine_for("qwen", request=False)  # (loaded at start in the background; waited for here)
        reply = chat(url, "deep", "deep-agent", [{"role": "user", "content": "hello"}])
        assert reply.status_code == 503, reply.text
        text = json.dumps(reply.json())
        assert "model deep needs about" in text and "qwen" in text and "models_budget_mb" in text
        assert reply.headers.get("retry-after")
        assert models_listing(url)["qwen"]["state"] == "resident"
        # The default model goes on serving.
        assert chat(url, "anything", "default-agent", [{"role": "user", "content": "hello"}]).status_code == 200
        # Unpinned through the admin API, qwen makes room for deep (least recently used).
        unpinned = httpx.post(f"{url}/v1/admin/models/qwen/pin?pinned=false", timeout=30)
        assert unpinned.status_code == 200 and unpinned.json()["pinned"] is False, unpinned.text
        assert chat(url, "deep", "deep-agent", [{"role": "user", "content": "hello"}]).status_code == 200
        assert models_listing(url)["qwen"]["state"] == "unloaded"
        refused = httpx.post(f"{url}/v1/admin/models/{folders['gemma4']}/pin", timeout=30)
        assert refused.status_code in (400, 404), refused.text


@pytest.mark.slow(reason="both real models in one server, five turns and a fork, three plain mlx-lm references: "
                          "59 s here, past 60 on a slower box")
def test_smollm2_serves_claude_codes_main_turns_and_gemma_3_its_haiku_tier(smollm2_path, gemma3_path, smollm2,
                                                                           gemma3, tmp_path: Path) -> None:
    """The real models: Gemma 3 270M as the side model beside SmolLM2, each token for token as alone."""
    messages = [{"role": "user", "content": "What is a KV cache? One sentence."}]
    with serving(smollm2_path, tmp_path / "cache", (f"gemma={gemma3_path},side",), pool_budget_mb=128) as (url,
                                                                                                        service):
        for model, loaded in (("claude-haiku-4-5-20251001", gemma3), ("claude-opus-4-8", smollm2)):
            reply = chat(url, model, f"real-{loaded.model_id}", messages)
            assert reply.status_code == 200, reply.text
            assert reply.headers[MODEL_HEADER] == loaded.identity.key == reply.json()["usage"]["semantic"]["model"]
            assert reply.json()["choices"][0]["message"]["content"] == expected(loaded, messages)
            again = chat(url, model, f"real-{loaded.model_id}", messages)  # each model's agent reuses its cache
            assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        side = message(url, "claude-haiku-4-5-20251001", "cc-real", "Reply with a title for this chat: caches")
        assert side.status_code == 200 and side.headers[MODEL_HEADER] == gemma3.identity.key
        # A direct agent forked from that context continues it in Gemma's template, not SmolLM2's.
        side_agent = next(a["agent_id"] for a in httpx.get(f"{url}/v1/agents", timeout=30).json()["data"]
                          if a["model"] == "gemma" and "cc-real" in a["agent_id"])
        fork = httpx.post(f"{url}/v1/agents/{side_agent}/fork?model=gemma", json={"name": "cc-fork"}, timeout=60)
        assert fork.status_code == 201, fork.text
        engine = dict(service.served_engines())["gemma"]
        context = engine.call(lambda e: list(e.agents.get("cc-fork").tokens)).result(30)
        text = "And a shorter one?"
        turn = httpx.post(f"{url}/v1/agents/cc-fork/messages", timeout=120, json={
            "content": text, "model": "gemma", "max_tokens": REPLY, "temperature": 0})
        assert turn.status_code == 200, turn.text
        prompt = context + list(PromptRenderer(gemma3.tokenizer).continuation((ChatMessage("user", text),)))
        eos = set(gemma3.eos_token_ids)
        want = [t for t in reference_greedy(gemma3.model, prompt, REPLY, eos) if t not in eos]
        # (The server ends the reply where the model starts writing the user's next turn; plain greedy goes on.)
        content = turn.json()["content"]
        assert len(content) > 8 and gemma3.tokenizer.decode(want).startswith(content), (turn.json(), want)
        assert turn.json()["usage"]["reused_tokens"] >= len(context) - engine.loaded.spec.block_tokens


def test_the_draft_model_is_a_resident_model_sharing_its_weights(folders, references, smollm2_path, smollm2,
                                                               tmp_path: Path) -> None:
    """--draft-model names an extra model by alias: SmolLM2 drafts for the Gemma 4 folder (same tokenizer) and
    serves its own requests with the same weights, held once in the budget."""
    messages = [{"role": "user", "content": "Count from one to ten, please."}]
    with serving(folders["gemma4"], tmp_path / "cache", (f"small={smollm2_path}",), draft_model="small",
                 speculate="draft") as (url, service):
        draft = service.engine.loaded.draft
        assert draft is not None and draft.loaded is not None and draft.loaded.path == smollm2.path
        for model, loaded in (("anything", references["gemma4"]), ("small", smollm2)):
            reply = chat(url, model, f"draft-{model}", messages)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["message"]["content"] == expected(loaded, messages)
        assert service.snapshot().model.speculation == f"draft model {draft.model_id}"
        small = dict(service.served_engines())["small"]
        assert small.loaded.model is draft.model  # one copy of SmolLM2's weights
        stats = httpx.get(f"{url}/v1/stats", timeout=30).json()
        rows = {row["alias"]: row for row in stats["models"]}
        assert rows["small"]["weights_bytes"] == 0 and rows["small"]["drafts_for"] == str(folders["gemma4"])
        from engine.resident_models import weights_nbytes

        assert rows[str(folders["gemma4"])]["weights_bytes"] == weights_nbytes(service.engine)  # the draft is there
        assert weights_nbytes(service.engine) > weights_nbytes(small)
        assert stats["models_budget"]["held_bytes"] == sum(r["pool_bytes"] + r["weights_bytes"]
                                                           for r in stats["models"])


async def test_the_workbench_shows_every_model_and_loads_one_from_the_palette(folders, tmp_path: Path) -> None:
    import asyncio

    from semantic_tui.app import SemanticApp
    from semantic_tui.backend import WorkbenchBackend
    from semantic_tui.preferences import load_preferences
    from semantic_tui.widgets.models_panel import ModelsPanel

    config = Settings(cache_dir=tmp_path / "cache", model=str(folders["gemma4"]), port=0, api_key=None,
                      extra_models=(f"qwen={folders['qwen35']}",), pool_budget_mb=POOL_MB,
                      default_max_tokens=48)  # a chat pane's turn names no limit; random weights never stop
    app = SemanticApp(WorkbenchBackend(config), load_preferences(tmp_path / "workbench.json"), poll_interval_s=0.1)

    async def until(condition, what: str, timeout_s: float = 30.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not condition():
            assert asyncio.get_running_loop().time() < deadline, what
            await pilot.pause(0.1)

    async with app.run_test(size=(160, 48)) as pilot:
        await until(lambda: app.backend.service.is_ready and app.screen is app.main, "the workbench ready")
        panel = app.main.query_one(ModelsPanel)
        text = lambda: str(panel.render())  # noqa: E731
        await until(lambda: "qwen" in text() and "unloaded" in text(), "the models panel")
        assert panel.display and "gemma4-tiny" in text() and "budget" in text()
        commands = {label: run for label, _, run in app.model_commands()}
        commands["model: load qwen"]()
        await until(lambda: "unloaded" not in text() and text().count("resident") == 2,
                    f"qwen resident: {text()!r} {app.backend.service.models.describe()}")
        assert {"model: unload qwen", "model: pin qwen", "chat: new on qwen"} <= {label for label, _, _ in
                                                                                  app.model_commands()}

        # The agents table lists each model's agents with a Model column; evict acts on the agent's own model.
        from semantic_tui.widgets.agents_table import AgentsTable, row_key

        url = app.backend.listener.url
        for model, session in (("qwen", "wb-qwen"), ("anything", "wb-default")):
            reply = await asyncio.to_thread(chat, url, model, session, [{"role": "user", "content": "hi"}])
            assert reply.status_code == 200, reply.text
        table = app.main.query_one(AgentsTable)
        keys = lambda: [table.coordinate_to_cell_key((r, 0)).row_key.value for r in range(table.row_count)]  # noqa: E731
        await until(lambda: {"oa-wb-default", row_key("qwen", "oa-wb-qwen")} <= set(keys()), f"both rows: {keys()}")
        assert "model" in [c.key.value for c in table.columns.values()]
        table.move_cursor(row=keys().index(row_key("qwen", "oa-wb-qwen")))
        await app.action_evict_warm()
        qwen = dict(app.backend.service.served_engines())["qwen"]
        await until(lambda: qwen.snapshot().agent("oa-wb-qwen").tier == "warm", "evicted in qwen")
        assert app.backend.service.snapshot().agent("oa-wb-default").tier == "hot"

        # The side panes follow the selected row's model: qwen's pool, tiers and throughput.
        await until(lambda: app.main.query_one("#pool").border_title == "Block pool · qwen", "qwen's pool shown")
        assert "▌qwen" in text()
        # A new chat on qwen (palette) is served by qwen: its agent is qwen's, its reply qwen's.
        from semantic_tui.widgets.chat_area import ChatArea

        {label: run for label, _, run in app.model_commands()}["chat: new on qwen"]()
        area = app.main.query_one(ChatArea)
        await until(lambda: area.pane_count == 1, "the chat pane")
        pane = area.panes[0]
        assert pane.model == "qwen"
        pane.send("hello there")
        await until(lambda: qwen.snapshot().agent(pane.agent_id) is not None and not pane.busy, "qwen's chat turn")
        assert app.backend.service.snapshot().agent(pane.agent_id) is None
        assert len(pane.history) == 2
        # A fork of it from the workbench stays in qwen, and its pane chats there.
        await until(lambda: row_key("qwen", pane.agent_id) in keys(), "the chat's row")
        table.move_cursor(row=keys().index(row_key("qwen", pane.agent_id)))
        await app.action_fork()
        fork_id = f"{pane.agent_id}-fork-1"
        await until(lambda: qwen.snapshot().agent(fork_id) is not None, "the fork in qwen")
        assert app.backend.service.snapshot().agent(fork_id) is None
        assert area.pane_for(fork_id, "qwen") is not None and len(area.pane_for(fork_id, "qwen").history) == 2
        models = app.backend.service.models
        await app.action_quit()
        # Quitting stops every model's engine (their agents to the warm tier) before the app exits.
        await until(lambda: not app.backend.service.is_ready and all(r["state"] == "unloaded"
                                                                      for r in models.describe()[1:]), "stopped")
