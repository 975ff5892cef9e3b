"""Turn a folder of benchmark results into one Markdown report with plots.

Run: ``python -m bench.report RESULTS_DIR``. Every ``*.json`` there (written by
a benchmark's ``--json``, see ``results.py``) becomes a section of
``RESULTS_DIR/report.md``; each series and each comparison workload becomes a
PNG under ``RESULTS_DIR/plots/``. The semantic vs mlx_lm.server summary comes
first. A file that cannot be read, or a benchmark that ``run_all.py`` ran but
that wrote nothing, is listed rather than stopping the report. Without
matplotlib the Markdown is still written, without plots.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from bench.results import BenchResult, Comparison, Metric, Series, Spread, load_result

RUNS_FILE = "runs.tsv"  # written by run_all.py: benchmark, exit status, seconds
PEER = "mlx_lm.server"


@dataclass(frozen=True, slots=True)
class Run:
    bench: str
    exit_code: int
    seconds: float


# -- numbers -------------------------------------------------------------------------------------


def fmt(value: float) -> str:
    if math.isnan(value):
        return "n/a"
    if math.isinf(value):
        return "∞" if value > 0 else "-∞"
    size = abs(value)
    if size >= 1000:
        return f"{value:,.0f}"
    if size >= 100:
        return f"{value:.1f}".removesuffix(".0")
    if size >= 10 or value == int(value):
        return f"{value:.2f}".rstrip("0").rstrip(".")
    if size < 0.001:  # a fixed point, never 8.57e-06: a reader compares these by eye
        return f"{value:.6f}".rstrip("0").rstrip(".")
    return f"{value:.3g}"


def with_unit(text: str, unit: str) -> str:
    if unit == "x":
        return f"{text}×"
    if unit == "%":
        return f"{text}%"
    return f"{text} {unit}".rstrip()


def spread(s: Spread, unit: str) -> str:
    return f"{with_unit(fmt(s.median), unit)} [{fmt(s.min)}–{fmt(s.max)}]"


def mark(met: bool | None) -> str:
    return {True: "✓", False: "✗", None: "–"}[met]


def target_text(target: float | None, better: str, unit: str) -> str:
    if target is None:
        return "–"
    return with_unit(f"{'≤' if better == 'lower' else '≥'} {fmt(target)}", unit)


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "plot"


# -- plots ---------------------------------------------------------------------------------------


class Plotter:
    """PNG files under ``folder``; ``available`` is False when matplotlib is not installed."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.errors: list[str] = []
        self._names: set[str] = set()
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            self.plt = None
        else:
            self.plt = plt

    @property
    def available(self) -> bool:
        return self.plt is not None

    def series(self, bench: str, series: Series) -> Path | None:
        return self._save(f"{bench}-{slug(series.name)}", lambda ax: self._draw_series(ax, series))

    def advantage(self, workload: str, comparisons: list[Comparison]) -> Path | None:
        return self._save(f"vs-{slug(workload)}", lambda ax: self._draw_advantage(ax, workload, comparisons))

    def _save(self, stem: str, draw) -> Path | None:
        if self.plt is None:
            return None
        name = stem
        while name in self._names:
            name += "-2"
        self._names.add(name)
        fig, ax = self.plt.subplots(figsize=(7, 4), dpi=110)
        try:
            draw(ax)
            ax.grid(axis="y", alpha=0.3)
            fig.tight_layout()
            self.folder.mkdir(parents=True, exist_ok=True)
            path = self.folder / f"{name}.png"
            fig.savefig(path)
            return path
        except Exception as exc:  # one bad series must not cost the whole report
            self.errors.append(f"{name}: {type(exc).__name__}: {exc}")
            return None
        finally:
            self.plt.close(fig)

    @staticmethod
    def _draw_series(ax, series: Series) -> None:
        ax.set_title(series.name)
        ax.set_xlabel(series.xlabel)
        ax.set_ylabel(series.ylabel)
        lines = {label: ys[: len(series.x)] for label, ys in series.lines.items()}
        ticks = series.x_labels or [fmt(x) for x in series.x]
        if series.kind == "bar":
            width = 0.8 / max(len(lines), 1)
            for i, (label, ys) in enumerate(lines.items()):
                positions = [j + (i - (len(lines) - 1) / 2) * width for j in range(len(ys))]
                bars = ax.bar(positions, ys, width, label=label)
                ax.bar_label(bars, labels=[fmt(y) for y in ys], fontsize=7)
            ax.set_xticks(range(len(series.x)), ticks)
        else:
            for label, ys in lines.items():
                ax.plot(series.x[: len(ys)], ys, marker="o", label=label)
            ax.set_xticks(series.x, ticks)
            ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)

    @staticmethod
    def _draw_advantage(ax, workload: str, comparisons: list[Comparison]) -> None:
        medians = [c.advantage.median for c in comparisons]
        errors = [[c.advantage.median - c.advantage.min for c in comparisons],
                  [c.advantage.max - c.advantage.median for c in comparisons]]
        colors = [{True: "tab:green", False: "tab:red", None: "tab:gray"}[c.met] for c in comparisons]
        positions = range(len(comparisons))
        bars = ax.bar(positions, medians, 0.6, yerr=errors, capsize=6, color=colors)
        ax.bar_label(bars, labels=[f"{fmt(m)}×" for m in medians], label_type="center", color="white")
        ax.set_xticks(positions, [c.metric for c in comparisons])
        ax.axhline(1.0, color="black", linewidth=0.8)
        targets = {c.target for c in comparisons if c.target is not None}
        if len(targets) == 1:
            target = next(iter(targets))
            ax.axhline(target, color="tab:blue", linestyle="--", label=f"target {fmt(target)}×")
            ax.legend(fontsize=8)
        else:  # each metric its own target: a dashed line over its own bar
            for i, c in enumerate(comparisons):
                if c.target is not None:
                    ax.hlines(c.target, i - 0.4, i + 0.4, color="tab:blue", linestyles="--")
        ax.set_title(f"{workload}: semantic vs {PEER}")
        ax.set_ylabel("semantic advantage (×; > 1 is better)")


# -- Markdown ------------------------------------------------------------------------------------


def table(headers: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return lines + ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]


def image(path: Path | None, root: Path, alt: str) -> list[str]:
    return [] if path is None else [f"![{alt}]({path.relative_to(root).as_posix()})", ""]


def header(results: list[BenchResult], folder: Path, plotter: Plotter) -> list[str]:
    lines = ["# semantic benchmark report", "",
             f"Generated {time.strftime('%Y-%m-%d %H:%M:%S')} from `{folder}`.", ""]
    lines += table(["machine", ""], machine_rows([r.machine for r in results])) + [""]
    if not plotter.available:
        lines += ["**Plots skipped: matplotlib is not installed** (`pip install matplotlib`).", ""]
    return lines


def machine_rows(machines: list[dict]) -> list[list[str]]:
    """One row per fact; where benchmarks saw different values (a rerun elsewhere), all of them."""

    def values(key: str) -> str:
        seen = [str(m[key]) for m in machines if m.get(key) not in (None, "")]
        return " / ".join(dict.fromkeys(seen)) or "unknown"

    preloads = dict.fromkeys(m.get("ld_preload", "") for m in machines)
    blas = "; ".join(f"LD_PRELOAD={p}" if p else "LD_PRELOAD not set" for p in preloads) or "unknown"
    loads = [m["load_average_1m"] for m in machines if m.get("load_average_1m") is not None]
    load = "unknown" if not loads else f"{fmt(min(loads))}–{fmt(max(loads))}"
    return [["CPU cores", values("cpus")], ["platform", values("platform")], ["python", values("python")],
            ["BLAS", blas], ["mlx", values("mlx")], ["mlx_lm", values("mlx_lm")],
            ["MLX device", values("mlx_device")], ["load average (1 min, at each benchmark's start)", load]]


def summary(results: list[BenchResult], folder: Path, plotter: Plotter) -> list[str]:
    lines = [f"## semantic vs {PEER}", ""]
    comparisons = [c for r in results for c in r.comparisons]
    if not comparisons:
        return lines + [f"No comparison with {PEER} in these results.", ""]
    rows = [[c.workload, c.metric, spread(c.semantic, c.unit), spread(c.peer, c.unit), spread(c.advantage, "x"),
             target_text(c.target, "higher", "x"), mark(c.met)] for c in comparisons]
    lines += table(["workload", "metric", "semantic median [min–max]", f"{PEER} median [min–max]",
                    "advantage median [min–max]", "target", "met"], rows)
    lines += ["", "Advantage: per repeat, the peer's value over semantic's for a time, semantic's over the "
              "peer's for a rate; above 1× semantic did better.", ""]
    by_workload: dict[str, list[Comparison]] = defaultdict(list)
    for c in comparisons:
        by_workload[c.workload].append(c)
    for workload, group in by_workload.items():
        lines += image(plotter.advantage(workload, group), folder, f"{workload}: advantage")
    return lines


def overview(results: list[BenchResult], runs: list[Run], broken: list[tuple[Path, str]], folder: Path) -> list[str]:
    by_bench = {r.bench: r for r in results}
    exits = {run.bench: run for run in runs}
    rows = []
    for name in dict.fromkeys([*(run.bench for run in runs), *by_bench]):
        result, run = by_bench.get(name), exits.get(name)
        status = "–" if run is None else ("ok" if run.exit_code == 0 else f"exit {run.exit_code}")
        seconds = result.duration_s if result else (run.seconds if run else float("nan"))
        log = f"[{name}.log]({name}.log)" if (folder / f"{name}.log").is_file() else "–"
        rows.append([f"`{name}`", result.title if result else "**no results written**", status, f"{fmt(seconds)} s",
                     log])
    lines = ["## Benchmarks", ""] + table(["benchmark", "title", "exit", "duration", "output"], rows) + [""]
    for path, error in broken:
        lines.append(f"- could not read `{path.name}`: {error}")
    return lines + ([""] if broken else [])


def section(result: BenchResult, folder: Path, plotter: Plotter) -> list[str]:
    lines = [f"## {result.title} (`{result.bench}`)", ""]
    load = result.machine.get("load_average_1m")
    args = ", ".join(f"{k}={v}" for k, v in result.args.items())
    lines += [f"Started {result.started_at}, took {fmt(result.duration_s)} s"
              + (f", load average {fmt(load)} at start" if load is not None else "")
              + (f"; {args}" if args else "") + ".", ""]
    if result.comparisons:
        lines += [f"{len(result.comparisons)} comparisons with {PEER}: see the summary above.", ""]
    groups: dict[str, list[Metric]] = defaultdict(list)
    for m in result.metrics:
        groups[m.group].append(m)
    for group, metrics in groups.items():
        lines += [f"### {group}", ""] + metric_table(metrics) + [""]
    for series in result.series:
        lines += image(plotter.series(result.bench, series), folder, series.name)
    if result.notes:
        lines += ["Notes:", ""] + [f"- {note}" for note in result.notes] + [""]
    return lines


def metric_table(metrics: list[Metric]) -> list[str]:
    arrows = {"higher": "↑", "lower": "↓"}
    if any(m.target is not None for m in metrics):
        rows = [[m.name, with_unit(fmt(m.value), m.unit), arrows.get(m.better, ""),
                 target_text(m.target, m.better, m.unit), mark(m.met)] for m in metrics]
        return table(["metric", "value", "better", "target", "met"], rows)
    rows = [[m.name, with_unit(fmt(m.value), m.unit), arrows.get(m.better, "")] for m in metrics]
    return table(["metric", "value", "better"], rows)


# -- the folder ----------------------------------------------------------------------------------


def load_all(folder: Path) -> tuple[list[BenchResult], list[tuple[Path, str]]]:
    results, broken = [], []
    for path in sorted(folder.glob("*.json")):
        try:
            results.append(load_result(path))
        except Exception as exc:  # a half-broken folder still gets a report
            broken.append((path, f"{type(exc).__name__}: {exc}"))
    return sorted(results, key=lambda r: r.started_at), broken


def read_runs(folder: Path) -> list[Run]:
    path = folder / RUNS_FILE
    if not path.is_file():
        return []
    runs = []
    for line in path.read_text().splitlines():
        parts = line.split("\t")
        if len(parts) == 3 and parts[1].lstrip("-").isdigit():
            runs.append(Run(parts[0], int(parts[1]), float(parts[2])))
    return runs


def write_report(folder: Path) -> Path:
    results, broken = load_all(folder)
    runs = read_runs(folder)
    # run_all's order, even after a rerun of one benchmark into the same folder
    order = {name: i for i, name in enumerate(dict.fromkeys(run.bench for run in runs))}
    results.sort(key=lambda r: (order.get(r.bench, len(order)), r.started_at))
    plotter = Plotter(folder / "plots")
    lines = header(results, folder, plotter) + summary(results, folder, plotter)
    lines += overview(results, runs, broken, folder)
    for result in results:
        lines += section(result, folder, plotter)
    if plotter.errors:
        lines += ["## Plots that failed", ""] + [f"- {error}" for error in plotter.errors] + [""]
    path = folder / "report.md"
    path.write_text("\n".join(lines))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a folder of benchmark results (*.json)")
    folder = parser.parse_args(argv).folder
    if not folder.is_dir():
        parser.error(f"{folder} is not a folder")
    print(write_report(folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
