"""One-file agent export and import: exact round trips, nothing written on refusal, the CLI."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from engine.domain.chat import ChatMessage
from engine.errors import (
    AgentExistsError,
    AgentModelMismatchError,
    AgentNotFoundError,
    CacheCorruptionError,
    InvalidAgentFileError,
)
from engine.models.loaded import ModelIdentity
from engine.store.agent_export import EXPORT_FIELD, export_agent, import_agent
from engine.store.agents_on_disk import (
    AgentOnDisk,
    DiskTier,
    ModelKey,
    conversation_store,
    list_agents,
    prefix_file,
)
from engine.store.cache_file import (
    CacheRecord,
    cache_file_path,
    new_header,
    read_cache_file,
    read_header,
    spec_fingerprint,
    write_cache_file,
)
from engine.store.file_names import AGENT_PREFIX, model_dir_name
from semantic_cli.main import main
from tests.unit.test_cache_file import (
    CUTS,
    HYBRID_WINDOWS,
    MODEL,
    OTHER_MODEL,
    PREFIX_KEY,
    assert_same_blocks,
    make_record,
    make_spec,
    random_blocks,
)

AGENT = "planner"
TINY_DIR = model_dir_name(MODEL.name, MODEL.digest)


def model_dir(cache: Path, model: ModelIdentity = MODEL) -> Path:
    return cache / "agents" / model_dir_name(model.name, model.digest)


def put_agent(cache: Path, record: CacheRecord, model: ModelIdentity = MODEL) -> Path:
    return write_cache_file(model_dir(cache, model), record).path


def key_of(model: ModelIdentity = MODEL, dtype: str = "float32") -> ModelKey:
    return ModelKey.of_model(model, make_spec(dtype))


def tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes: a refused import must leave this unchanged."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def read_as_tiny(path: Path) -> CacheRecord:
    return read_cache_file(path, MODEL.digest, spec_fingerprint(make_spec()))


def add_conversation(cache: Path, agent_id: str = AGENT, turns: int = 2) -> None:
    store = conversation_store(cache)
    store.create(agent_id, "You plan.", "Planner")
    for i in range(turns):
        store.record_turn(agent_id, f"question {i}", f"answer {i}")


@pytest.fixture
def source(tmp_path: Path) -> Path:
    cache = tmp_path / "source"
    put_agent(cache, make_record(agent_id=AGENT, cuts=CUTS))
    return cache


@pytest.fixture
def exported(source: Path, tmp_path: Path) -> Path:
    return export_agent(source, AGENT, tmp_path / "planner.safetensors").path


# -- round trips --------------------------------------------------------------------------------
def test_import_writes_the_warm_file_byte_for_byte(source: Path, tmp_path: Path) -> None:
    original = cache_file_path(model_dir(source), AGENT)
    summary = export_agent(source, AGENT, tmp_path / "out.safetensors")
    assert (summary.agent_id, summary.n_tokens, summary.also_in, summary.inlined_prefix_tokens) == (AGENT, 10, (), 0)
    assert summary.nbytes == summary.path.stat().st_size
    assert summary.model.startswith(f"tiny@{MODEL.digest[:16]} (4-token float32 blocks")
    # The export is a regular cache file: the ordinary reader takes it, the marker in extra.
    header = read_header(summary.path)
    assert header.extra[EXPORT_FIELD]["model_dir"] == TINY_DIR and "conversation" not in header.extra[EXPORT_FIELD]
    imported = import_agent(tmp_path / "target", summary.path)
    assert imported.path == model_dir(tmp_path / "target") / original.name
    assert (imported.agent_id, imported.n_tokens, imported.replaced, imported.conversation_turns) == (AGENT, 10, False, None)
    # Export marker dropped: exactly the file the warm tier wrote, checkpoints and extra included.
    assert imported.path.read_bytes() == original.read_bytes()


def test_export_file_is_owner_only_and_replaced_atomically(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "shared-folder" / "planner.safetensors"
    out.parent.mkdir(mode=0o755)
    out.write_bytes(b"an older export")
    export_agent(source, AGENT, out)
    assert out.stat().st_mode & 0o777 == 0o600
    assert out.parent.stat().st_mode & 0o777 == 0o755  # the user's folder keeps its mode
    assert sorted(os.listdir(out.parent)) == ["planner.safetensors"]  # no temp file left
    assert read_header(out).agent_id == AGENT


def test_export_needs_a_cache_on_disk(source: Path, tmp_path: Path) -> None:
    with pytest.raises(AgentNotFoundError, match="'nobody' has no cache on disk"):
        export_agent(source, "nobody", tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()


def test_export_picks_the_newest_model_unless_told(source: Path, tmp_path: Path) -> None:
    newer = make_record(agent_id=AGENT, n_tokens=12)
    newer = CacheRecord(replace(newer.header, model_name=OTHER_MODEL.name, model_digest=OTHER_MODEL.digest,
                                last_used=newer.header.last_used + 60), newer.blocks)
    put_agent(source, newer, OTHER_MODEL)
    summary = export_agent(source, AGENT, tmp_path / "a.safetensors")
    assert summary.n_tokens == 12 and summary.model.startswith("other@")
    assert len(summary.also_in) == 1 and summary.also_in[0].startswith("tiny@")
    for key in (TINY_DIR, "tiny", MODEL.key, key_of()):
        chosen = export_agent(source, AGENT, tmp_path / "b.safetensors", key)
        assert chosen.n_tokens == 10 and chosen.model.startswith("tiny@"), key
    with pytest.raises(AgentNotFoundError, match=r"no cache for model gemma; it has caches for (tiny|other)@"):
        export_agent(source, AGENT, tmp_path / "c.safetensors", "gemma")


# -- shared prefixes ------------------------------------------------------------------------------
def put_prefix(cache: Path, shared: int, tokens_from: CacheRecord) -> CacheRecord:
    """A shared prefix file holding the first ``shared`` tokens, every group, as the warm tier stores it."""
    spec = make_spec()
    blocks = []
    for group in spec.groups:
        blocks += random_blocks(group.index, 0, shared, "float32")
    classes = ["RotatingKVCache" if w else "KVCache" for w in HYBRID_WINDOWS]
    meta = [{"max_size": w, "keep": 0} if w else {} for w in HYBRID_WINDOWS]
    header = new_header(AGENT_PREFIX + PREFIX_KEY, MODEL, spec, tokens_from.header.token_ids[:shared],
                        classes, meta, source="prefix")
    record = CacheRecord(header, tuple(blocks))
    path = write_cache_file(model_dir(cache) / "prefixes", record).path
    assert path == prefix_file(model_dir(cache), PREFIX_KEY)
    return record


def test_export_inlines_the_shared_prefix_and_stands_alone(tmp_path: Path) -> None:
    cache = tmp_path / "source"
    agent = make_record(agent_id=AGENT, cuts=CUTS, shared=8)
    put_agent(cache, agent)
    prefix = put_prefix(cache, 8, agent)
    summary = export_agent(cache, AGENT, tmp_path / "out.safetensors")
    assert summary.inlined_prefix_tokens == 8
    standalone = read_as_tiny(summary.path)
    assert standalone.header.prefix is None
    # The global group's first blocks are the prefix file's, then the agent's own; sliding
    # groups and checkpoints are the agent's only (the prefix file's windows are not taken).
    global_prefix = tuple(b for b in prefix.blocks if b.group == 0)
    assert_same_blocks(CacheRecord(agent.header, global_prefix + agent.blocks), standalone)
    # Stands alone: with the source gone, the import still holds every block.
    (prefix_file(model_dir(cache), PREFIX_KEY)).unlink()
    imported = import_agent(tmp_path / "target", summary.path)
    assert_same_blocks(CacheRecord(agent.header, global_prefix + agent.blocks), read_as_tiny(imported.path))
    assert not (model_dir(tmp_path / "target") / "prefixes").exists()


def test_export_refuses_a_missing_or_mismatched_prefix(tmp_path: Path) -> None:
    cache = tmp_path / "source"
    agent = make_record(agent_id=AGENT, shared=4)
    put_agent(cache, agent)
    with pytest.raises(CacheCorruptionError, match="shared prefix file .* is gone"):
        export_agent(cache, AGENT, tmp_path / "out.safetensors")
    other_tokens = CacheRecord(replace(agent.header, token_ids=[t + 1 for t in agent.header.token_ids]), ())
    put_prefix(cache, 4, other_tokens)
    with pytest.raises(CacheCorruptionError, match="does not hold agent 'planner''s first 4 tokens"):
        export_agent(cache, AGENT, tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()


def test_import_refuses_a_file_that_refers_to_a_prefix(tmp_path: Path) -> None:
    warm = put_agent(tmp_path / "source", make_record(agent_id=AGENT, shared=4))
    with pytest.raises(InvalidAgentFileError, match="shared prefix file it does not hold"):
        import_agent(tmp_path / "target", warm)
    assert not (tmp_path / "target").exists()


# -- refusals change nothing ----------------------------------------------------------------------
@pytest.fixture
def target(tmp_path: Path) -> Path:
    """A cache directory that already holds another agent and its conversation."""
    cache = tmp_path / "target"
    put_agent(cache, make_record(agent_id="resident"))
    add_conversation(cache, "resident")
    return cache


@pytest.mark.parametrize("where", ["data", "header", "checksum digits", "truncated"])
def test_a_tampered_file_is_refused_and_nothing_changes(exported: Path, target: Path, where: str) -> None:
    data = bytearray(exported.read_bytes())
    if where == "truncated":
        del data[-1]
    else:
        at = {"data": len(data) - 5, "header": data.index(b"planner"),
              "checksum digits": data.index(b"crc32:") + 6}[where]
        data[at] ^= 0x01
    exported.write_bytes(bytes(data))
    before = tree(target)
    with pytest.raises(InvalidAgentFileError, match="not a valid agent export"):
        import_agent(target, exported)
    assert tree(target) == before


def test_a_file_of_another_model_is_refused_naming_both(exported: Path, target: Path) -> None:
    before = tree(target)
    with pytest.raises(AgentModelMismatchError) as caught:
        import_agent(target, exported, expected_model_key=key_of(OTHER_MODEL))
    message = str(caught.value)
    assert f"cached by tiny@{MODEL.digest[:16]}" in message and f"target is other@{OTHER_MODEL.digest[:16]}" in message
    assert tree(target) == before


def test_a_file_of_another_cache_layout_is_refused_naming_both(exported: Path, tmp_path: Path) -> None:
    cache = tmp_path / "half-precision"
    put_agent(cache, make_record("float16", agent_id="resident"))
    before = tree(cache)
    with pytest.raises(AgentModelMismatchError, match="4-token float32 blocks.*4-token float16 blocks"):
        import_agent(cache, exported)
    with pytest.raises(AgentModelMismatchError, match="float32.*float16"):
        import_agent(cache, exported, expected_model_key=key_of(dtype="float16"))
    assert tree(cache) == before
    # The loaded model's own key is accepted where its folder holds no other layout.
    assert import_agent(tmp_path / "fresh", exported, expected_model_key=key_of()).agent_id == AGENT


def test_an_existing_agent_is_replaced_only_when_told(exported: Path, target: Path) -> None:
    import_agent(target, exported)
    before = tree(target)
    with pytest.raises(AgentExistsError, match="'planner' already exists"):
        import_agent(target, exported)
    assert tree(target) == before
    assert import_agent(target, exported, replace_existing=True).replaced
    assert tree(target) == before  # the same agent again: the same bytes
    renamed = import_agent(target, exported, new_id="planner-2")
    assert read_header(renamed.path).agent_id == "planner-2" and not renamed.replaced


@pytest.mark.parametrize("how", ["conversation", "cold"])
def test_a_conversation_or_cold_entry_counts_as_existing(exported: Path, target: Path, how: str) -> None:
    if how == "conversation":
        add_conversation(target, AGENT)
    else:
        cold = model_dir(target) / "cold.json"
        cold.write_text(json.dumps({"agents": [{"agent_id": AGENT, "n_tokens": 99, "last_used": 1.0}]}))
    before = tree(target)
    with pytest.raises(AgentExistsError):
        import_agent(target, exported)
    assert tree(target) == before
    import_agent(target, exported, replace_existing=True)
    rows = [r for r in list_agents(target) if r.agent_id == AGENT]
    assert [(r.tier, r.conversation_turns) for r in rows] == [(DiskTier.WARM, None)]  # old conversation gone


def test_a_bad_new_id_is_refused(exported: Path, target: Path) -> None:
    before = tree(target)
    with pytest.raises(Exception, match="new_id must be 1-128 characters"):
        import_agent(target, exported, new_id="../escape")
    assert tree(target) == before


# -- conversations ------------------------------------------------------------------------------
def test_the_conversation_travels_with_the_cache(source: Path, tmp_path: Path) -> None:
    add_conversation(source, AGENT, turns=3)
    summary = export_agent(source, AGENT, tmp_path / "out.safetensors")
    assert summary.conversation_turns == 3
    imported = import_agent(tmp_path / "target", summary.path, new_id="planner-copy")
    assert imported.conversation_turns == 3
    copy = conversation_store(tmp_path / "target").get("planner-copy")
    original = conversation_store(source).get(AGENT)
    assert copy is not None and original is not None
    assert (copy.system, copy.display_name) == ("You plan.", "Planner")
    assert copy.messages == original.messages
    assert copy.messages[-1] == ChatMessage("assistant", "answer 2")
    assert conversation_store(tmp_path / "target").get(AGENT) is None


def test_a_malformed_conversation_is_refused(source: Path, tmp_path: Path) -> None:
    warm = cache_file_path(model_dir(source), AGENT)
    record = read_as_tiny(warm)
    bad = {"exported_at": 1.0, "conversation": {"version": 1, "agent_id": AGENT, "messages": "no"}}
    forged = write_cache_file(tmp_path / "forged", CacheRecord(
        replace(record.header, extra={EXPORT_FIELD: bad}), record.blocks)).path
    with pytest.raises(InvalidAgentFileError, match="conversation is malformed"):
        import_agent(tmp_path / "target", forged)
    assert not (tmp_path / "target").exists()


# -- listing --------------------------------------------------------------------------------------
def test_list_agents_reports_every_agent_on_disk(source: Path) -> None:
    add_conversation(source, AGENT, turns=2)
    add_conversation(source, "never-ran", turns=0)
    other = put_agent(source, CacheRecord(replace(make_record(agent_id="coder", n_tokens=12).header,
                                                  model_name=OTHER_MODEL.name, model_digest=OTHER_MODEL.digest),
                                          make_record(agent_id="coder", n_tokens=12).blocks), OTHER_MODEL)
    (model_dir(source) / "cold.json").write_text(
        json.dumps({"agents": [{"agent_id": "sleeper", "n_tokens": 40, "last_used": 5.0}]}))
    warm = cache_file_path(model_dir(source), AGENT)
    rows = list_agents(source)
    never_ran = conversation_store(source).get("never-ran")
    assert never_ran is not None
    assert rows == [
        AgentOnDisk("coder", DiskTier.WARM, other.parent.name, OTHER_MODEL.key, 12, other.stat().st_size, None,
                    other.stat().st_mtime),
        AgentOnDisk("never-ran", DiskTier.NONE, None, None, 0, 0, 0, never_ran.updated_at),
        AgentOnDisk(AGENT, DiskTier.WARM, TINY_DIR, MODEL.key, 10, warm.stat().st_size, 2, warm.stat().st_mtime),
        AgentOnDisk("sleeper", DiskTier.COLD, TINY_DIR, None, 40, 0, None, 5.0),
    ]


def test_list_agents_of_an_empty_or_missing_directory(tmp_path: Path) -> None:
    assert list_agents(tmp_path / "nowhere") == []


# -- the CLI ------------------------------------------------------------------------------------
def cli(capsys: pytest.CaptureFixture[str], cache: Path, *args: str) -> tuple[int, str, str]:
    code = main(["agents", *args, "--cache-dir", str(cache)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_export_import_list(source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    add_conversation(source, AGENT, turns=1)
    out_file = tmp_path / "planner.safetensors"
    code, out, err = cli(capsys, source, "export", AGENT, str(out_file))
    assert code == 0 and err == ""
    assert out.startswith(f"exported 'planner' to {out_file}: 10 tokens, ")
    assert f"model tiny@{MODEL.digest[:16]}" in out and "conversation of 1 turns" in out
    target = tmp_path / "target"
    code, out, err = cli(capsys, target, "import", str(out_file), "--as", "planner-2")
    assert code == 0 and out.startswith("imported 'planner-2': 10 tokens, ")
    code, out, _ = cli(capsys, target, "list")
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["ID", "TIER", "MODEL", "FOLDER", "TOKENS", "SIZE", "TURNS", "LAST",
                                              "WRITTEN"]
    assert len(lines) == 2 and lines[1].split()[:4] == ["planner-2", "warm", TINY_DIR, "10"]
    code, out, _ = cli(capsys, target, "list", "--json")
    (row,) = [json.loads(line) for line in out.splitlines()]
    assert (row["agent_id"], row["tier"], row["n_tokens"], row["conversation_turns"]) == ("planner-2", "warm", 10, 1)


def test_cli_errors_are_one_line(source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_file = tmp_path / "planner.safetensors"
    assert cli(capsys, source, "export", AGENT, str(out_file))[0] == 0
    code, out, err = cli(capsys, source, "import", str(out_file))
    assert (code, out) == (1, "")
    assert err == "semantic: agent 'planner' already exists; pass --replace to overwrite it, or --as NEW_ID\n"
    code, _, err = cli(capsys, source, "export", "ghost", str(out_file))
    assert code == 1 and err.startswith("semantic: agent 'ghost' has no cache on disk") and err.count("\n") == 1
    out_file.write_bytes(out_file.read_bytes()[:-1])
    code, _, err = cli(capsys, tmp_path / "target", "import", str(out_file))
    assert code == 1 and err.startswith("semantic: not a valid agent export: ") and err.count("\n") == 1
    assert "truncated" in err


def test_cli_usage_errors_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["agents", "export", AGENT, "--cache-dir", str(tmp_path)])
    assert caught.value.code == 2
    assert "the following arguments are required: FILE" in capsys.readouterr().err


def test_cli_list_of_an_empty_cache(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cli(capsys, tmp_path, "list") == (0, f"no agents in {tmp_path / 'agents'}\n", "")
