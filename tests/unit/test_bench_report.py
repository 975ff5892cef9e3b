"""The benchmark results files and the report built from them: exact numbers, marks and plots."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest
from bench.portable_paths import REPOSITORY, main as portable_main, portable
from bench.report import write_report
from bench.results import BenchResult, Metric, Series, compare, load_result
from bench.run_all import bench_name, parse_args


pytestmark = pytest.mark.unit


def peer_result() -> BenchResult:
    result = BenchResult("bench_vs_mlx_lm_server", "semantic vs mlx_lm.server", {"repeats": 3})
    # A time: peer / ours per repeat = 2, 3, 1.5 -> median 2, target 1.5 met.
    result.comparisons.append(compare("A: resume", "TTFT", "s", [0.5, 0.4, 0.6], [1.0, 1.2, 0.9], target=1.5))
    # A rate: ours / peer per repeat = 1.1, 0.9, 1.0 -> median 1, target 1.2 missed.
    result.comparisons.append(compare("B: 8 agents", "decode", "tok/s", [110.0, 90.0, 100.0], [100.0, 100.0, 100.0],
                                      better="higher", target=1.2))
    result.comparisons.append(compare("B: 8 agents", "TTFT", "s", [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]))
    result.notes.append("Workload A restores a 4K-token conversation.")
    return result


def engine_result() -> BenchResult:
    result = BenchResult("bench_engine", "Engine: batching scaling", {"quick": True})
    result.metric("decode throughput", "semantic, 16 agents", 123.456, "tok/s")
    result.metric("block pool", "allocate p95", 0.004, "ms", "lower", target=0.01)
    result.metric("block pool", "snapshot p95", 2.5, "ms", "lower", target=1.0)
    result.series.append(Series("batching scaling", "agents", "tok/s", [1, 4, 8, 16],
                                {"semantic": [20.0, 60.0, 90.0, 123.0], "mlx_lm": [25.0] * 4}))
    result.series.append(Series("second-turn TTFT", "prompt tokens", "s", [512, 2048],
                                {"reuse": [0.1, 0.2], "full": [0.5, 2.0]}, "bar", ["short", "long"]))
    return result


def write_all(folder: Path, *results: BenchResult) -> None:
    for result in results:
        result.write(folder / f"{result.bench}.json")


def test_compare_pairs_repeats_and_divides_the_peer_time_by_ours_when_lower_is_better() -> None:
    c = compare("w", "TTFT", "s", [1.0, 2.0, 4.0], [2.0, 3.0, 4.0], target=1.5)
    assert c.advantage.values == [2.0, 1.5, 1.0]
    assert (c.advantage.min, c.advantage.median, c.advantage.max) == (1.0, 1.5, 2.0)
    assert (c.semantic.min, c.semantic.median, c.semantic.max) == (1.0, 2.0, 4.0)
    assert c.peer.median == 3.0
    assert c.met is True


def test_compare_divides_our_rate_by_the_peers_when_higher_is_better() -> None:
    c = compare("w", "decode", "tok/s", [20.0, 30.0], [10.0, 20.0], better="higher", target=2.0)
    assert c.advantage.values == [2.0, 1.5]
    assert c.advantage.median == 1.75
    assert c.met is False
    assert compare("w", "decode", "tok/s", [1.0], [1.0], better="higher").met is None


def test_compare_refuses_unpaired_repeats() -> None:
    with pytest.raises(ValueError, match="2 semantic runs vs 1 peer runs"):
        compare("w", "TTFT", "s", [1.0, 2.0], [1.0])


def test_a_metric_meets_its_target_in_the_direction_that_is_better() -> None:
    assert Metric("g", "p95", 0.004, "ms", "lower", 0.01).met is True
    assert Metric("g", "p95", 0.02, "ms", "lower", 0.01).met is False
    assert Metric("g", "tok/s", 90.0, "tok/s", "higher", 100.0).met is False
    assert Metric("g", "tokens", 90.0, "tokens", "neither", 100.0).met is None
    assert Metric("g", "tok/s", 90.0, "tok/s").met is None


def test_results_round_trip_through_a_file(tmp_path: Path) -> None:
    for result in (peer_result(), engine_result()):
        result.duration_s = 12.5
        path = tmp_path / f"{result.bench}.json"
        result.write(path)
        assert load_result(path) == result
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_written_result_names_the_machines_folders_as_a_reader_elsewhere_reads_them(tmp_path: Path) -> None:
    """A model folder made under the temporary folder, the home folder and the repository become $TMPDIR, ~ and
    ``.``; a name that only begins like one of them stays."""
    home, temp = str(Path.home()), tempfile.gettempdir()
    result = BenchResult("bench_x", "x", {"model": f"{temp}/bench-families-1/llama", "cache": f"{home}/.cache/semantic",
                                          "report": str(REPOSITORY / "bench" / "reports"), "other": f"{temp}x/y"})
    result.notes.append(f"served from {temp}/m, logs in {home}")
    path = tmp_path / "r.json"
    result.write(path)
    written = load_result(path)
    assert written.args == {"model": "$TMPDIR/bench-families-1/llama", "cache": "~/.cache/semantic",
                            "report": "./bench/reports", "other": f"{temp}x/y"}
    assert written.notes == ["served from $TMPDIR/m, logs in ~"]
    assert portable([f"{temp}", ("a", f"{home}/b")]) == ["$TMPDIR", ["a", "~/b"]]


def test_kept_logs_are_rewritten_in_place(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    log.write_text(f"loading {tempfile.gettempdir()}/dbg/model\nok\n")
    assert portable_main([str(log)]) == 0
    assert log.read_text() == "loading $TMPDIR/dbg/model\nok\n"


def test_a_file_written_before_targets_and_tick_labels_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "bench_engine.json"
    engine_result().write(path)
    raw = json.loads(path.read_text())
    for item in raw["metrics"] + raw["series"]:
        item.pop("target", None)
        item.pop("x_labels", None)
    path.write_text(json.dumps(raw))
    loaded = load_result(path)
    assert loaded.metrics[1].target is None and loaded.series[1].x_labels is None


def test_a_file_from_another_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"schema": 0}))
    with pytest.raises(ValueError, match="schema 0"):
        load_result(path)


def test_report_summary_gives_medians_ranges_and_marks(tmp_path: Path) -> None:
    write_all(tmp_path, peer_result(), engine_result())
    report = write_report(tmp_path).read_text()
    lines = report.splitlines()
    summary = lines.index("## semantic vs mlx_lm.server")
    assert summary < lines.index("## Benchmarks")
    assert "| A: resume | TTFT | 0.5 s [0.4–0.6] | 1 s [0.9–1.2] | 2× [1.5–3] | ≥ 1.5× | ✓ |" in lines
    assert "| B: 8 agents | decode | 100 tok/s [90–110] | 100 tok/s [100–100] | 1× [0.9–1.1] | ≥ 1.2× | ✗ |" in lines
    assert "| B: 8 agents | TTFT | 1 s [1–1] | 1 s [1–1] | 1× [1–1] | – | – |" in lines
    assert "- Workload A restores a 4K-token conversation." in lines


def test_report_sections_group_metrics_and_mark_targets(tmp_path: Path) -> None:
    write_all(tmp_path, engine_result())
    lines = write_report(tmp_path).read_text().splitlines()
    assert "## Engine: batching scaling (`bench_engine`)" in lines
    assert lines[lines.index("### decode throughput") + 4] == "| semantic, 16 agents | 123.5 tok/s | ↑ |"
    block_pool = lines.index("### block pool")
    assert lines[block_pool + 2:block_pool + 6] == [
        "| metric | value | better | target | met |",
        "|---|---|---|---|---|",
        "| allocate p95 | 0.004 ms | ↓ | ≤ 0.01 ms | ✓ |",
        "| snapshot p95 | 2.5 ms | ↓ | ≤ 1 ms | ✗ |",
    ]
    assert "| CPU cores | " in "\n".join(lines)


def test_report_draws_one_png_per_series_and_per_comparison_workload(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    write_all(tmp_path, peer_result(), engine_result())
    report = write_report(tmp_path).read_text()
    plots = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert plots == ["bench_engine-batching-scaling.png", "bench_engine-second-turn-ttft.png",
                     "vs-a-resume.png", "vs-b-8-agents.png"]
    for name in plots:
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"(plots/{name})" in report


def test_report_without_matplotlib_still_writes_the_markdown(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    write_all(tmp_path, engine_result())
    report = write_report(tmp_path).read_text()
    assert "Plots skipped: matplotlib is not installed" in report
    assert "| semantic, 16 agents | 123.5 tok/s | ↑ |" in report
    assert not (tmp_path / "plots").exists()


def test_report_lists_failed_benchmarks_and_unreadable_files(tmp_path: Path) -> None:
    write_all(tmp_path, engine_result())
    (tmp_path / "bench_swap.json").write_text("{not json")
    (tmp_path / "bench_swap.log").write_text("Traceback ...\n")
    (tmp_path / "runs.tsv").write_text("bench_engine\t0\t31.0\nbench_swap\t1\t4.2\n")
    lines = write_report(tmp_path).read_text().splitlines()
    assert "| `bench_engine` | Engine: batching scaling | ok | 0 s | – |" in lines
    assert "| `bench_swap` | **no results written** | exit 1 | 4.2 s | [bench_swap.log](bench_swap.log) |" in lines
    assert any(line.startswith("- could not read `bench_swap.json`: JSONDecodeError") for line in lines)
    assert "No comparison with mlx_lm.server in these results." in lines


def test_run_all_names_benchmarks_loosely_and_passes_other_options_on(tmp_path: Path) -> None:
    assert bench_name("engine") == bench_name("bench_engine.py") == "bench_engine"
    args, extra = parse_args(["--quick", "--skip", "ui_overhead", "vs_mlx_lm_server", "--out", str(tmp_path),
                              "--cache-dir", "cache"])
    assert (args.out, args.only, args.skip) == (tmp_path, None, ["bench_ui_overhead", "bench_vs_mlx_lm_server"])
    assert extra == ["--quick", "--cache-dir", "cache"]
    with pytest.raises(SystemExit):
        parse_args(["--only", "nonsense"])


def test_the_peer_at_its_defaults_gets_no_flag_a_user_would_not_set(tmp_path: Path) -> None:
    from bench.served import Batching, peer_defaults_launch, peer_launch

    defaults = peer_defaults_launch(tmp_path)
    assert defaults.argv[1:] == ("-m", "mlx_lm.server", "--model", str(tmp_path), "--log-level", "WARNING")
    tuned = peer_launch(tmp_path, Batching(), cache_entries=10)
    assert "--decode-concurrency" in tuned.argv and "--prompt-cache-size" in tuned.argv
