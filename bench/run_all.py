"""Run every benchmark in turn, then write the report (``make bench``; ``make bench ARGS=--quick`` for a smoke run).

Benchmarks run one after another, never together: they share two CPU cores
and each one's numbers assume the machine is otherwise quiet. Each writes
``OUT/<benchmark>.json`` and its printed output to ``OUT/<benchmark>.log``; a
benchmark that fails does not stop the others. ``bench/report.py`` then turns
the folder into ``OUT/report.md`` with plots under ``OUT/plots/``.

Options not listed below (``--quick``, ``--model``, ``--cache-dir``...) are
passed on to every benchmark except bench_block_pool, which takes none.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.report import RUNS_FILE, write_report

HERE = Path(__file__).resolve().parent
ORDER = (
    "bench_block_pool",
    "bench_engine",
    "bench_cache_store",
    "bench_swap",
    "bench_vs_mlx_lm_server",
    "bench_ui_overhead",
)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=f"benchmarks, in order: {', '.join(ORDER)}")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="results folder (default: bench/results/<YYYYmmdd-HHMMSS>)")
    parser.add_argument("--only", nargs="+", metavar="NAME", type=bench_name,
                        help="run only these benchmarks (e.g. bench_engine or engine)")
    parser.add_argument("--skip", nargs="+", metavar="NAME", type=bench_name, default=[],
                        help="leave these benchmarks out (e.g. vs_mlx_lm_server ui_overhead)")
    args, extra = parser.parse_known_args(argv)
    args.out = args.out or HERE / "results" / time.strftime("%Y%m%d-%H%M%S")
    return args, extra


def bench_name(text: str) -> str:
    """``bench_engine.py``, ``bench_engine`` and ``engine`` all name the same benchmark."""
    stem = Path(text).stem
    name = stem if stem.startswith("bench_") else f"bench_{stem}"
    if name not in ORDER:
        raise argparse.ArgumentTypeError(f"unknown benchmark {text!r} (one of: {', '.join(ORDER)})")
    return name


def run_one(name: str, extra: list[str], out: Path) -> int:
    """Run a benchmark with its output shown live and kept in ``OUT/<name>.log``."""
    args = ["--json", str(out / f"{name}.json"), *([] if name == "bench_block_pool" else extra)]
    print(f"\n# ===== {name} {' '.join(args)}", flush=True)
    with open(out / f"{name}.log", "w") as log:
        # Unbuffered: a pipe would otherwise hold a long benchmark's progress back until it ends.
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        process = subprocess.Popen([sys.executable, "-m", f"bench.{name}", *args], cwd=HERE.parent, env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        for line in process.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            log.write(line)
        return process.wait()


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    args.out.mkdir(parents=True, exist_ok=True)
    chosen = [n for n in ORDER if (args.only is None or n in args.only) and n not in args.skip]
    failed = []
    with open(args.out / RUNS_FILE, "a") as runs:
        for name in chosen:
            if not (HERE / f"{name}.py").is_file():
                continue
            start = time.perf_counter()
            code = run_one(name, extra, args.out)
            seconds = time.perf_counter() - start
            print(f"# ===== {name}: exit {code} after {seconds:.0f} s", flush=True)
            runs.write(f"{name}\t{code}\t{seconds:.1f}\n")
            runs.flush()
            if code != 0:
                failed.append(name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}")
    print(f"\nreport: {write_report(args.out)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
