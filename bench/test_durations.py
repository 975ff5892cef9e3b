"""Where a test run's time goes: per test, per file, per kind, from pytest's JUnit XML.

    .venv/bin/python -m pytest --junitxml=run.xml ...     # any run (make test PYTEST_ARGS=--junitxml=run.xml)
    make test JUNIT_DIR=DIR                                  # DIR/unit.xml and DIR/model.xml
    python -m bench.test_durations DIR/unit.xml DIR/model.xml [--top 25] [--markdown]

A test's time is its setup, call and teardown together (JUnit's ``time``),
so a module fixture that starts a server counts against the first test that
needs it. ``kind`` is the directory: unit (tests/unit) or model (tests/model).
The unit tests run on several workers: their times add up to more than the
wall time they took.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class TestTime:
    file: str  # tests/unit/test_x.py
    name: str
    seconds: float
    outcome: str  # passed, failed, error, skipped

    @property
    def kind(self) -> str:
        return self.file.split("/")[1] if self.file.count("/") >= 2 else "other"


def read(path: Path) -> list[TestTime]:
    tests = []
    for case in ET.parse(path).iter("testcase"):
        module = case.get("classname", "")
        parts = module.split(".")
        # classname is the module path (tests.unit.test_x), with a class name after it for class-based tests.
        file_parts = [p for p in parts if not p[:1].isupper()]
        file = "/".join(file_parts) + ".py"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
        tests.append(TestTime(file, case.get("name", ""), float(case.get("time", 0.0)), outcome))
    return tests


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {seconds % 60:04.1f} s" if seconds >= 60 else f"{seconds:.1f} s"


def table(headers: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths))]
    return "\n".join(out + ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows])


def report(tests: list[TestTime], top: int, markdown: bool) -> str:
    total = sum(t.seconds for t in tests)
    by_kind: dict[str, list[TestTime]] = defaultdict(list)
    by_file: dict[str, list[TestTime]] = defaultdict(list)
    for test in tests:
        by_kind[test.kind].append(test)
        by_file[test.file].append(test)
    outcomes = defaultdict(int)
    for test in tests:
        outcomes[test.outcome] += 1
    parts = [f"{len(tests)} tests, {minutes(total)} of test time "
             f"({', '.join(f'{n} {o}' for o, n in sorted(outcomes.items()))})", ""]
    parts += [table(["kind", "tests", "time"], [[k, str(len(v)), minutes(sum(t.seconds for t in v))]
                                                 for k, v in sorted(by_kind.items())], markdown), ""]
    slow = sorted(tests, key=lambda t: -t.seconds)[:top]
    parts += [f"The {top} slowest tests:", "",
              table(["#", "test", "kind", "time"], [[str(i + 1), f"{t.file}::{t.name}", t.kind, minutes(t.seconds)]
                                                    for i, t in enumerate(slow)], markdown), ""]
    files = sorted(by_file.items(), key=lambda kv: -sum(t.seconds for t in kv[1]))[:top]
    parts += [f"The {top} slowest files:", "",
              table(["file", "tests", "time"], [[f, str(len(v)), minutes(sum(t.seconds for t in v))]
                                                for f, v in files], markdown)]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", type=Path, nargs="+", help="pytest --junitxml output (several: one run's parts)")
    parser.add_argument("--top", type=int, default=25, help="rows in the slowest-tests and slowest-files tables")
    parser.add_argument("--markdown", action="store_true", help="tables as Markdown (docs/development.md)")
    args = parser.parse_args(argv)
    tests: list[TestTime] = []
    for path in args.junit:
        try:
            tests += read(path)
        except (OSError, ET.ParseError) as exc:
            print(f"test_durations: cannot read {path}: {exc}", file=sys.stderr)
            return 2
    print(report(tests, args.top, args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
