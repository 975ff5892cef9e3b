"""Which mlx-lm model families the engine accepts at load, and which it serves token for token like mlx-lm.

The families are those of mlx-lm's own model tests (the mlx-lm repository,
``tests/test_models.py``): ``harvest`` reads the tiny configs out of that file
(the keyword arguments of ``X.ModelArgs(...)``, the dicts of
``ModelArgs.from_dict`` and of ``test_all_models``' list) into
``bench/family_configs.json``, one entry per model type (the config of the
test that runs the model, else the first), plus llama's sliding-window
variant, a cache layout of its own.

``run`` then takes each family in a subprocess of its own, under a timeout,
so that a native crash or a hang is that family's result:

1. mlx-lm's ``Model`` from the config, vocabulary set to the byte tokenizer's
   (258); test configs over 60M parameters shrunk (``SHRINK``: same family,
   same layer kinds, smaller widths or depth); weights varied with
   ``random_model.vary`` so that greedy replies are not one repeated token;
2. the load check: ``derive_cache_spec``, as the loader calls it (refused:
   ``UnsupportedModelError``);
3. one plain mlx-lm forward, so that a family mlx-lm itself cannot run on this
   machine is not counted against the engine;
4. 3 turns of up to 8 greedy tokens through the engine, each turn's prompt
   extending the last (its prefix should be reused), each compared token for
   token with mlx-lm's greedy ``generate_step`` on the same prompt
   (``tests/support/reference.reference_greedy``).

Written to ``--out``: results.json (one record per family, and each run's
commit, machine and versions) and results.md (a table, refusals by cause, the
families that could not be compared). ``--weight-scale``/``--vector-sd``
other than vary()'s defaults re-run families whose replies had few distinct
tokens (the table notes them) into results_vary.json, shown in its own
section of results.md.

Run (from the repository root; LD_PRELOAD as for every benchmark on Linux)::

    python -m bench.family_survey harvest --test-file ~/src/mlx-lm/tests/test_models.py
    python -m bench.family_survey run --out family_survey
    python -m bench.family_survey run --out family_survey --only phi gemma --weight-scale 4 --vector-sd 0.3

A full run (102 families) takes about 10 minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CONFIGS = Path(__file__).resolve().parent / "family_configs.json"
VOCAB = 258  # tests/support/byte_tokenizer.py VOCAB_SIZE
TURNS = 3
TOKENS = 8
BLOCK_TOKENS = 16
MAX_PARAMS = 60_000_000  # above this (after the vocabulary change) a config is shrunk via SHRINK
LOW_DIVERSITY = 3  # at most this many distinct reply tokens: a cache bug could go unseen; re-run with --weight-scale
DEFAULT_VARY = (2.0, 1.0)  # random_model.vary's own weight_scale and vector_sd

# Test configs too big for a CPU run -> the same family at a smaller shape (keys overridden; same layer kinds).
SHRINK: dict[str, dict] = {
    "phi": dict(hidden_size=256, num_hidden_layers=4, intermediate_size=512, num_attention_heads=8,
                num_key_value_heads=8),
    "phi3": dict(hidden_size=256, num_hidden_layers=4, intermediate_size=512, num_attention_heads=8),
    "qwen": dict(hidden_size=256, num_hidden_layers=4, intermediate_size=1024, num_attention_heads=8,
                 kv_channels=32),
    "cohere": dict(hidden_size=256, num_hidden_layers=4, intermediate_size=512, num_attention_heads=8,
                   num_key_value_heads=8),
    "cohere2": dict(hidden_size=256, num_hidden_layers=8, intermediate_size=512, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, sliding_window=24),
    "falcon_h1": dict(hidden_size=256, num_hidden_layers=4, intermediate_size=512, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=32, mamba_d_ssm=256, mamba_n_heads=8, mamba_d_head=32,
                      mamba_d_state=32),
    "gpt_neox": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8),
    "gpt2": dict(n_embd=256, n_layer=4, n_head=8),
    "mamba": dict(hidden_size=128, num_hidden_layers=4, intermediate_size=256, time_step_rank=8),
    "openelm": dict(model_dim=256, head_dim=32, num_transformer_layers=4, ffn_multipliers=[0.5, 1.0, 1.5, 2.0],
                    num_kv_heads=[2, 2, 4, 4], num_query_heads=[4, 4, 8, 8], ffn_dim_divisor=64),
    "nanochat": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4),
    "gpt_oss": dict(hidden_size=256, intermediate_size=256, num_local_experts=4),
    "bailing_moe_linear": dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256),
    "dbrx": dict(d_model=256, ffn_config={"ffn_hidden_size": 512, "moe_num_experts": 4, "moe_top_k": 2}),
    "lfm2_moe": dict(hidden_size=256, intermediate_size=1024, moe_intermediate_size=256),
    "qwen2_moe": dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                      shared_expert_intermediate_size=512),
    "qwen3_moe": dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256),
    "gpt_bigcode": dict(n_layer=4),
    "starcoder2": dict(hidden_size=256, intermediate_size=512),
    "plamo2": dict(hidden_size=256, intermediate_size=512),
}

# Test configs small in parameters but slow on a CPU, always shrunk: Jamba's mamba_expand of 128 gives a
# 16,384-wide selective scan whose 87-token prefill takes plain mlx-lm 233 s here.
SLOW = {"jamba": dict(mamba_expand=4, mamba_d_state=16)}

# Families that cannot be compared on a CPU, diagnosed by hand; shown beside their result.
DIAGNOSES = {
    "phi3small": "plain mlx-lm alone segfaults on the CPU on an 8-token forward of this model (no engine "
                 "involved; 2 tokens work), so neither side can be run here: not comparable",
    "bitnet": "bitnet's BitLinear needs a Metal kernel; no CPU forward",
    "olmo": "mlx-lm's olmo imports hf_olmo (ai2-olmo) and calls sys.exit(1) without it",
}


# -- harvest ------------------------------------------------------------------------------------------------


def _literal(node: ast.AST):
    return eval(compile(ast.Expression(node), "<config>", "eval"), {"__builtins__": {}}, {})


def harvest(test_file: Path) -> list[dict]:
    """Every model config in mlx-lm's test file: test, module, config, runner (the test runs the model), skipped."""
    tree = ast.parse(test_file.read_text())
    tests = next(n for n in tree.body if isinstance(n, ast.ClassDef))
    found: list[dict] = []
    for fn in tests.body:
        if isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_"):
            found += _configs_in(fn)
    return found


def _configs_in(fn: ast.FunctionDef) -> list[dict]:
    skipped = any(isinstance(d, ast.Call) and getattr(d.func, "attr", "") == "skip" for d in fn.decorator_list)
    runner = any(isinstance(n, ast.Attribute) and n.attr == "model_test_runner" for n in ast.walk(fn))
    modules = {a.asname or a.name: a.name for n in ast.walk(fn)  # `from mlx_lm.models import X as Y`
               if isinstance(n, ast.ImportFrom) and n.module == "mlx_lm.models" for a in n.names}
    found = []
    for node in ast.walk(fn):
        if fn.name == "test_all_models" and isinstance(node, ast.Assign) \
                and getattr(node.targets[0], "id", "") == "test_configs":
            found += [dict(test=fn.name, module=c["model_type"], config=c, runner=True, skipped=skipped)
                      for c in _literal(node.value)]
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        f = node.func
        if f.attr == "ModelArgs" and isinstance(f.value, ast.Name) and f.value.id in modules:
            try:
                config = {k.arg: _literal(k.value) for k in node.keywords}
            except Exception as e:  # noqa: BLE001  (kept, so the family shows up with why it was not built)
                config = {"_harvest_error": repr(e)}
            found.append(dict(test=fn.name, module=modules[f.value.id], config=config, runner=runner,
                              skipped=skipped))
        elif f.attr == "from_dict" and isinstance(f.value, ast.Attribute) and f.value.attr == "ModelArgs" \
                and isinstance(f.value.value, ast.Name) and f.value.value.id in modules and node.args:
            try:
                config = _literal(node.args[0])
            except Exception:  # noqa: BLE001  (qwen3_5's loop builds its dict from a loop variable)
                continue
            found.append(dict(test=fn.name, module=modules[f.value.value.id], config=config, runner=runner,
                              skipped=skipped))
    return found


def select(found: list[dict]) -> list[dict]:
    """One entry per model type, keyed by it: the config of a test that runs the model, else the first; and
    llama's sliding-window config as ``llama[sliding]``."""
    chosen: dict[str, dict] = {}
    for e in found:
        model_type = e["config"].get("model_type") or e["module"]
        if model_type not in chosen or (e["runner"] and not chosen[model_type]["runner"]):
            chosen[model_type] = dict(e, key=model_type, model_type=model_type)
    sliding = [dict(e, key="llama[sliding]", model_type="llama") for e in found
               if e["test"] == "test_llama_model_sliding_attention"]
    return list(chosen.values()) + sliding


# -- one family (in its own process) ------------------------------------------------------------------------


class Skipped(Exception):
    """The family cannot be built here for a reason outside the engine."""


def entry(key: str) -> dict:
    """The family's entry of family_configs.json (``key``: a model_type, or llama[sliding])."""
    found = next((e for e in json.loads(CONFIGS.read_text()) if e["key"] == key), None)
    if found is None:
        raise SystemExit(f"unknown family {key}; keys are in {CONFIGS}")
    return found


def with_vocab(config: dict) -> dict:
    """The config with every vocabulary size (also a nested text_config's) set to the byte tokenizer's."""
    config = json.loads(json.dumps(config))
    for c in (config, config.get("text_config")):
        if isinstance(c, dict):
            for k in ("vocab_size", "vocab_size_per_layer_input", "embedding_size"):
                if k in c:
                    c[k] = VOCAB
            c["vocab_size"] = VOCAB
    return config


def build(entry: dict):
    """mlx-lm's model for the entry (shrunk if too big), and 'N M params -> n M' if it was shrunk."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    name = f"mlx_lm.models.{entry['module']}"
    try:
        module = importlib.import_module(name)
    except SystemExit as e:  # olmo exits instead of raising ImportError when its dependency is missing
        raise Skipped(f"importing {name} exits (sys.exit({e.code}))") from None

    def make(config: dict):
        mx.random.seed(0)
        model = module.Model(module.ModelArgs.from_dict(config))
        return model, sum(v.size for _, v in tree_flatten(model.parameters()))  # lazy: nothing evaluated

    config = with_vocab(entry["config"])
    config.setdefault("model_type", entry["model_type"])
    if entry["model_type"] in SLOW:
        model, n_params = make(dict(config, **SLOW[entry["model_type"]]))
        return model, f"test config shrunk for the CPU ({', '.join(SLOW[entry['model_type']])})"
    model, n_params = make(config)
    if n_params <= MAX_PARAMS:
        return model, None
    if entry["model_type"] not in SHRINK:
        raise Skipped(f"{n_params / 1e6:.0f}M parameters and no shrunk config")
    model, shrunk = make(dict(config, **SHRINK[entry["model_type"]]))
    return model, f"test config {n_params / 1e6:.0f}M params -> {shrunk / 1e6:.1f}M"


def survey_family(entry: dict, weight_scale: float, vector_sd: float) -> dict:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from engine.errors import UnsupportedModelError
    from engine.models.cache_spec import derive_cache_spec
    from engine.models.materialize import evaluate_all_arrays
    from bench.random_model import vary

    res: dict = dict(key=entry["key"], model_type=entry["model_type"], test=entry["test"])
    if entry.get("skipped"):
        res["note"] = "test is @unittest.skip in mlx-lm"
    t0 = time.perf_counter()
    try:
        model, shrunk = build(entry)
    except Skipped as e:
        return dict(res, status="skip", reason=str(e))
    except Exception as e:  # noqa: BLE001  (a config mlx-lm's own class rejects)
        return dict(res, status="build_error", reason=f"model build failed: {type(e).__name__}: {one_line(e)}")
    if shrunk:
        res["shrunk"] = shrunk
    vary(model, 0, weight_scale=weight_scale, vector_sd=vector_sd)
    # As the loader does: the engine runs the model on a thread of its own, where an array built lazily here
    # (a scaled RoPE's private frequencies) could not be evaluated.
    evaluate_all_arrays(model)
    if (weight_scale, vector_sd) != DEFAULT_VARY:
        res["vary"] = f"vary(weight_scale={weight_scale:g}, vector_sd={vector_sd:g})"
    res["params_M"] = round(sum(v.size for _, v in tree_flatten(model.parameters())) / 1e6, 2)
    try:
        spec = derive_cache_spec(model, block_tokens=BLOCK_TOKENS)
    except UnsupportedModelError as e:
        return dict(res, status="refused", accepted=False, reason=f"{type(e).__name__}: {one_line(e)}",
                    caches=cache_types(model))
    except Exception as e:  # noqa: BLE001  (not a clean refusal: a bug in the load check)
        return dict(res, status="load_error", reason=f"{type(e).__name__}: {one_line(e)}")
    res.update(accepted=True, layout=spec.layer_summary())
    stage(res)  # a native crash from here on still leaves "accepted" on record
    try:
        logits = model(mx.array([[256, 65]]))
        mx.eval(logits)
    except Exception as e:  # noqa: BLE001
        return dict(res, status="plain_error",
                    reason=f"plain mlx-lm forward fails here: {type(e).__name__}: {one_line(e)}")
    if logits.shape[-1] != VOCAB:  # the byte tokenizer could not read the replies, nor the prompt ids fit
        return dict(res, status="skip", reason=f"vocabulary {logits.shape[-1]} != {VOCAB} after the override")
    res["stage"] = "serving (the engine run or the mlx-lm reference)"
    stage(res)
    try:
        serve(model, spec, res)
    except Exception as e:  # noqa: BLE001
        res.update(status="serve_error", reason=f"{type(e).__name__}: {one_line(e)}")
    res.pop("stage")
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res


def stage(res: dict) -> None:
    print("STAGE " + json.dumps(res), flush=True)


def cache_types(model) -> str:
    """What mlx-lm's make_cache gives the model, e.g. '3xKVCache, 1xArraysCache'."""
    if not hasattr(model, "make_cache"):
        return "KVCache (default)"
    try:
        return ", ".join(f"{n}x{t}" for t, n in Counter(type(c).__name__ for c in model.make_cache()).items())
    except Exception as e:  # noqa: BLE001
        return f"make_cache failed: {e}"


def serve(model, spec, res: dict) -> None:
    """TURNS turns through the engine, each against mlx-lm's greedy reference; the outcome into ``res``."""
    from engine.domain.requests import GenerationRequest
    from engine.models.loaded import LoadedModel, ModelIdentity
    from engine.runtime.engine_thread.engine import Engine
    from engine.runtime.engine_thread.sync_client import run_turn
    from tests.support.byte_tokenizer import BOS, EOS, ByteTokenizer
    from tests.support.engine_settings import engine_settings
    from tests.support.reference import reference_greedy

    name = f"tiny-{res['key']}"
    loaded = LoadedModel(model_id=name, identity=ModelIdentity(name, "seed0000" * 4), path=Path("/nonexistent") / name,
                         architecture=res["model_type"], model=model, tokenizer=ByteTokenizer(), spec=spec,
                         context_length=2048)
    engine = Engine(loaded, engine_settings(max(64 << 20, 4 * spec.bytes_for_tokens(1024)), 8, 32), store=None)
    engine.start()
    turns: list[dict] = []
    try:
        prompt = (BOS, *("agent 1 opens a conversation about caches. " * 2).encode())
        for turn in range(TURNS):
            result = run_turn(engine, GenerationRequest("chat", prompt, TOKENS))
            if result.finish.error is not None:
                res.update(status="serve_error", reason=f"turn {turn + 1}: engine error: {one_line(result.finish.error)}")
                break
            ref = reference_greedy(model, list(prompt), TOKENS, {EOS})
            turns.append(compare(result, ref[:-1] if ref[-1:] == [EOS] else ref, len(prompt), res))
            prompt = prompt + tuple(result.tokens) + tuple(f" then turn {turn} says more.".encode())
    finally:
        engine.stop()
    res.update(turns=turns, identical=[t["identical"] for t in turns], reused=[t["reused"] for t in turns],
               distinct_tokens=len({tok for t in turns for tok in t["engine"]}))
    if "status" not in res:
        first = next((i for i, t in enumerate(turns) if not t["identical"]), None)
        res["status"] = "ok" if first is None else "mismatch"
        if first is not None:
            res["reason"] = f"turn {first + 1}: engine {turns[first]['engine']} != mlx-lm {turns[first]['ref']}"


def compare(result, ref: list[int], prompt_tokens: int, res: dict) -> dict:
    from tests.support.byte_tokenizer import EOS

    got = result.tokens
    if got[-1:] == [EOS] and got[:-1] == ref:
        # The engine emits the EOS token's event when EOS flushes a pending partial UTF-8 character (its
        # text: a replacement character); the tokens are otherwise identical.
        res["eos_event"] = True
        got = got[:-1]
    usage = result.finish.usage
    return dict(engine=result.tokens, ref=ref, identical=got == ref, reused=usage.reused_tokens,
                prefilled=usage.prefilled_tokens, prompt=prompt_tokens)


def one_line(e: object, n: int = 220) -> str:
    s = " ".join(str(e).split())
    return s if len(s) <= n else s[: n - 1] + "…"


# -- run: every family, then the report ---------------------------------------------------------------------


def git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT).stdout.strip()


def tree_state() -> dict:
    """HEAD and the tracked files that differ from it (the family processes import the working tree)."""
    diff = subprocess.run(["git", "diff", "HEAD"], capture_output=True, cwd=ROOT).stdout
    changed = git("diff", "HEAD", "--name-only").split()
    return dict(commit=git("rev-parse", "--short", "HEAD"), dirty=bool(changed), changed=changed,
                diff_sha1=hashlib.sha1(diff).hexdigest()[:10])


def machine() -> dict:
    from importlib.metadata import version

    cpu = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")), None)
    return dict(platform=platform.platform(), cpu=cpu or platform.processor() or platform.machine(),
                cpu_count=os.cpu_count(), python=platform.python_version(), mlx=version("mlx"),
                mlx_lm=version("mlx-lm"), ld_preload=os.environ.get("LD_PRELOAD"))


def _cpuinfo() -> list[str]:
    path = Path("/proc/cpuinfo")  # Linux only; elsewhere platform.processor() names the CPU
    return path.read_text().splitlines() if path.exists() else []


def run_family(entry: dict, args: argparse.Namespace) -> dict:
    """The family's result from a process of its own: a segfault or a hang ends only that process."""
    command = [sys.executable, "-m", "bench.family_survey", "family", entry["key"], "--weight-scale", str(args.weight_scale),
               "--vector-sd", str(args.vector_sd)]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=args.timeout)
        out, err, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out, err, rc = _text(e.stdout), _text(e.stderr), None
    lines = out.splitlines()
    result = next((json.loads(line[7:]) for line in lines if line.startswith("RESULT ")), None)
    if result is not None:
        return result
    staged = [json.loads(line[6:]) for line in lines if line.startswith("STAGE ")]
    res = staged[-1] if staged else dict(key=entry["key"], model_type=entry["model_type"], test=entry["test"])
    status = "timeout" if rc is None else "crash"
    where = f" while {res.pop('stage')}" if "stage" in res else ""
    last = (err.strip().splitlines() or ["(no output)"])[-1]
    what = f"after {args.timeout:g} s" if rc is None else f"rc {rc}"
    return dict(res, status=status, reason=f"{status} ({what}){where}: {one_line(last)}")


def _text(captured: bytes | str | None) -> str:
    # What a timed-out subprocess.run captured comes back as bytes, text=True or not.
    return captured.decode(errors="replace") if isinstance(captured, bytes) else captured or ""


def run(args: argparse.Namespace) -> None:
    entries = json.loads(CONFIGS.read_text())
    unknown = set(args.only or ()) - {e["key"] for e in entries}
    if unknown:
        raise SystemExit(f"unknown family {', '.join(sorted(unknown))}; keys are in {CONFIGS}")
    varied = (args.weight_scale, args.vector_sd) != DEFAULT_VARY
    path = args.out / ("results_vary.json" if varied else "results.json")
    # --only adds to (or replaces some of) an earlier run's results; a full run starts over.
    saved = json.loads(path.read_text()) if args.only and path.exists() else dict(runs=[], families={})
    meta = dict(date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), only=args.only,
                timeout_s=args.timeout, weight_scale=args.weight_scale, vector_sd=args.vector_sd,
                tree=tree_state(), machine=machine())
    saved["runs"].append(meta)
    args.out.mkdir(parents=True, exist_ok=True)
    for entry in entries:
        if args.only and entry["key"] not in args.only:
            continue
        t0 = time.perf_counter()
        res = run_family(entry, args)
        res["wall"] = round(time.perf_counter() - t0, 1)
        saved["families"][entry["key"]] = res
        print(f"{entry['key']:28s} {res['status']:12s} {res.get('reason', '')[:150]}", flush=True)
        path.write_text(json.dumps(saved, indent=1))
    end = tree_state()
    if end != meta["tree"]:
        meta["tree_at_end"] = end
        path.write_text(json.dumps(saved, indent=1))
    (args.out / "results.md").write_text(report(args.out, entries))
    print(f"wrote {path} and {args.out / 'results.md'}")


# -- results.md ---------------------------------------------------------------------------------------------


def report(out: Path, entries: list[dict]) -> str:
    main = _load(out / "results.json")
    varied = _load(out / "results_vary.json")
    results = main["families"]
    order = [e["key"] for e in entries if e["key"] in results]
    counts = Counter(results[k]["status"] for k in order)
    lines = ["# The engine against mlx-lm's test families", "",
             f"Configs: mlx-lm's tests/test_models.py (bench/family_configs.json), vocabulary -> {VOCAB}, weights "
             f"varied with bench/random_model.vary; block_tokens={BLOCK_TOKENS}, {TURNS} turns x {TOKENS} tokens, "
             "reference: tests/support/reference.reference_greedy. Made by bench/family_survey.py.", "",
             *[_run_line(r) for r in main["runs"]], "",
             f"**{len(order)} families: " + ", ".join(f"{n} {s}" for s, n in counts.most_common()) + "**", "",
             *_table(results, order), "", "## Refusals by cause", "", *_refusals(results, order)]
    if varied["families"]:
        lines += ["", f"## Re-run with stronger weight variation (default vary() gave these <= {LOW_DIVERSITY} "
                  "distinct tokens)", "", *[_run_line(r) for r in varied["runs"]], "", *_varied(varied["families"])]
    other = [k for k in order if results[k]["status"] not in ("ok", "refused")]
    if other:
        lines += ["", "## Not ok for other reasons", ""]
        lines += [f"- {k}: {results[k]['status']}: {results[k].get('reason', '')}" for k in other]
    return "\n".join(lines) + "\n"


def _load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else dict(runs=[], families={})


def _run_line(run: dict) -> str:
    tree, m = run["tree"], run["machine"]
    dirty = f"dirty: {', '.join(tree['changed'])} (diff sha1 {tree['diff_sha1']})" if tree["dirty"] else "clean"
    end = run.get("tree_at_end")
    changed = f"; CHANGED during the run, at the end {end['commit']} diff sha1 {end['diff_sha1']}" if end else ""
    what = f"families {', '.join(run['only'])}" if run["only"] else "all families"
    if (run["weight_scale"], run["vector_sd"]) != DEFAULT_VARY:
        what += f", vary(weight_scale={run['weight_scale']:g}, vector_sd={run['vector_sd']:g})"
    return (f"- {run['date']}, {what}: commit {tree['commit']} ({dirty}{changed}); mlx {m['mlx']}, mlx-lm "
            f"{m['mlx_lm']}, Python {m['python']}; {m['platform']}, {m['cpu_count']} CPUs ({m['cpu']}); "
            f"LD_PRELOAD={m['ld_preload']}; timeout {run['timeout_s']} s")


def _table(results: dict, order: list[str]) -> list[str]:
    rows = ["| model_type | accepted at load | token-identical 3 turns | reuse (reused tokens, turns 2-3) | "
            "reason / error / notes |", "|---|---|---|---|---|"]
    for key in order:
        r = results[key]
        accepted = {True: "yes", False: "no"}.get(r.get("accepted"), "n/a (not built)")
        identical = reuse = "—"
        if "identical" in r:
            identical = "yes" if r["status"] == "ok" else "no (" + "".join("✓" if x else "✗" for x in r["identical"]) + ")"
            later = r["reused"][1:]
            reuse = ("yes " if later and all(x > 0 for x in later) else "no ") + f"({', '.join(map(str, later))})"
        name = key if key == r["model_type"] else f"{r['model_type']} ({key.split('[')[1].rstrip(']')})"
        rows.append(f"| {name} | {accepted} | {identical} | {reuse} | {'; '.join(_notes(r)).replace('|', '/')} |")
    return rows


def _notes(r: dict) -> list[str]:
    notes = [r["reason"]] if r.get("reason") else []
    if r["status"] == "refused":
        notes.append(f"make_cache: {r['caches']}")
    if r.get("layout") and r["status"] in ("ok", "mismatch"):
        notes.append(f"layout: {r['layout']}")
    if r["key"] in DIAGNOSES and r["status"] != "ok":
        notes.append("diagnosis: " + DIAGNOSES[r["key"]])
    if r.get("eos_event"):
        notes.append("engine also emitted the EOS token's event (EOS flushed a partial UTF-8 char); compared without it")
    notes += [r[k] for k in ("shrunk", "note") if r.get(k)]
    if r.get("distinct_tokens", LOW_DIVERSITY + 1) <= LOW_DIVERSITY:
        notes.append(f"only {r['distinct_tokens']} distinct output tokens")
    if r["test"] not in ("test_all_models", f"test_{r['model_type']}"):
        notes.append(f"config from {r['test']}")
    return notes


def cause(reason: str) -> str:
    """The kind of model a refusal is about, from the engine's message."""
    if "ArraysCache" in reason or "MambaCache" in reason:
        return "ArraysCache (linear attention / SSM / recurrent state)"
    if "CacheList" in reason:
        return "CacheList (several caches per layer)"
    if "keep=" in reason:
        return "RotatingKVCache with keep>0 (attention sinks)"
    if "layers but" in reason and "previous_kvs" in reason:
        return "fewer caches than layers and no previous_kvs map (KV-sharing layers)"
    if "caches for" in reason:
        return "more caches than layers (looped layers, a cache per pass)"
    if "cannot tell its head_dim" in reason:
        return "attention geometry not found"
    if " uses " in reason:
        return "other cache class: " + reason.split(" uses ")[1].split(" ")[0]
    return "other: " + reason


def _refusals(results: dict, order: list[str]) -> list[str]:
    groups: dict[str, list[str]] = {}
    for key in order:
        if results[key]["status"] == "refused":
            groups.setdefault(cause(results[key]["reason"]), []).append(key)
    return [f"- **{c}** ({len(keys)}): {', '.join(keys)}" for c, keys in sorted(groups.items(), key=lambda kv: -len(kv[1]))]


def _varied(results: dict) -> list[str]:
    rows = ["| model_type | vary | token-identical 3 turns | reuse (turns 2-3) | distinct tokens |", "|---|---|---|---|---|"]
    for key, r in results.items():
        ok = "yes" if r["status"] == "ok" else f"{r['status']}: {r.get('reason', '')}"
        rows.append(f"| {key} | {r.get('vary')} | {ok} | {', '.join(map(str, r.get('reused', [])[1:]))} | "
                    f"{r.get('distinct_tokens')} |")
    return rows


# -- command line -------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="The module docstring (bench/family_survey.py) says what each step checks.")
    commands = parser.add_subparsers(dest="command", required=True)
    harvest_ = commands.add_parser("harvest", help=f"regenerate {CONFIGS.name} from mlx-lm's tests/test_models.py")
    harvest_.add_argument("--test-file", type=Path, required=True, metavar="PATH",
                          help="a copy of tests/test_models.py from the mlx-lm repository, at the installed version")
    run_ = commands.add_parser("run", help="survey the families, each in a subprocess; write results.json and .md")
    run_.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "family_survey",
                      help="folder for results.json, results_vary.json and results.md (default: family_survey in "
                           "the system's temporary folder)")
    run_.add_argument("--only", nargs="+", metavar="KEY",
                      help=f"survey only these families (keys of {CONFIGS.name}: a model_type, or llama[sliding]), "
                           "keeping the others' earlier results in --out")
    run_.add_argument("--timeout", type=float, default=120, metavar="S",
                      help="seconds one family may take before it counts as a timeout (default 120)")
    family = commands.add_parser("family", help="survey one family in this process and print its RESULT line "
                                                "(what run starts per family)")
    family.add_argument("key", help=f"a family key of {CONFIGS.name} (a model_type, or llama[sliding])")
    for p in (run_, family):
        p.add_argument("--weight-scale", type=float, default=DEFAULT_VARY[0], metavar="W",
                       help=f"random_model.vary's scale on weight matrices (default {DEFAULT_VARY[0]:g}); this or "
                            "--vector-sd off its default sends the results to results_vary.json")
        p.add_argument("--vector-sd", type=float, default=DEFAULT_VARY[1], metavar="SD",
                       help=f"random_model.vary's noise on vectors: norms, biases (default {DEFAULT_VARY[1]:g})")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.command == "harvest":
        entries = select(harvest(args.test_file))
        CONFIGS.write_text(json.dumps(entries, indent=1))
        print(f"wrote {CONFIGS}: {len(entries)} families, {sum(e['skipped'] for e in entries)} of them @skip in mlx-lm")
    elif args.command == "family":
        print("RESULT " + json.dumps(survey_family(entry(args.key), args.weight_scale, args.vector_sd)), flush=True)
    else:
        run(args)


if __name__ == "__main__":
    main()
