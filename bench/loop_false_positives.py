"""How often closing a constrained reply's loops would close legitimate JSON: the rules run over real files.

A constrained reply is steered closed when its JSON shape finds an array repeating its items or its own
exact guard finds a cycle repeated over half of ``EXACT_WINDOW`` tokens (engine/grammar/token_constraint.py).
Closing legitimate output early loses data, so both rules are run, exactly as the engine runs them, over
text a model may legitimately be asked to write:

- the array rule (``JsonShape``) over every JSON file of this repository and its installed packages, each
  re-written as the engine's grammar writes JSON (``", "`` and ``": "`` separators, no other whitespace);
- the exact guard over every source and documentation file of bench_runaway's corpus (this repository,
  mlx-lm, Textual, Rich, httpx, FastAPI, pydantic) written as a JSON string's content (escaped, as a strict
  tool call carries a file), tokenized with the model's tokenizer, first ``--tokens`` tokens, and at the
  other windows named in ``--windows`` for comparison.

Run: ``python -m bench.loop_false_positives [--model M] [--tokens 2048] [--windows 64,96,128,192] [--json PATH]``.
"""

from __future__ import annotations

import json
import site
import sys
from pathlib import Path

from bench.bench_runaway import corpus_files, tokenizer_of
from bench.bench_vs_mlx_lm_server import model_folder
from bench.common import ROOT, base_parser, print_table
from bench.results import BenchResult, recorded
from engine.domain.repetition import RepetitionGuard
from engine.grammar.json_shape import JsonShape
from engine.grammar.token_constraint import EXACT_WINDOW

MAX_JSON_BYTES = 200_000  # of each file, re-written: enough to hold many arrays, not a whole tokenizer.json


def json_files() -> list[Path]:
    roots = [ROOT, *(Path(p) for p in site.getsitepackages())]
    found = {p.resolve() for root in roots for p in root.rglob("*.json") if ".git" not in p.parts}
    return sorted(found)


def array_rule(files: list[Path]) -> tuple[int, list[str]]:
    """(files read, the files where the array rule fires, each with the item it saw)."""
    read, fired = 0, []
    for path in files:
        try:
            value = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, UnicodeDecodeError):
            continue
        read += 1
        text = json.dumps(value, ensure_ascii=False, separators=(", ", ": ")).encode()[:MAX_JSON_BYTES]
        shape = JsonShape()
        shape.feed(text)
        if shape.repeated is not None:
            fired.append(f"{path.name}: {shape.repeated.describe()}")
    return read, fired


def exact_guard(tokenizer, windows: list[int], limit: int) -> dict[int, list[str]]:
    """Per window, the corpus files (as JSON string content) where the exact guard fires."""
    fired: dict[int, list[str]] = {w: [] for w in windows}
    texts = []
    for path in corpus_files():
        content = json.dumps(path.read_text(errors="ignore"), ensure_ascii=False)[1:-1]
        texts.append((path.name, tokenizer.encode(content)[:limit]))
    for window in windows:
        for name, tokens in texts:
            guard = RepetitionGuard(window, near=False)
            loop = next((loop for t in tokens if (loop := guard.push(t)) is not None), None)
            if loop is not None:
                fired[window].append(f"{name}: {loop.describe()}")
    return fired


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of each source file read (default 2048)")
    parser.add_argument("--windows", default=f"64,96,{EXACT_WINDOW},192",
                        help=f"exact-guard windows to measure (default 64,96,{EXACT_WINDOW},192; the engine's: "
                             f"{EXACT_WINDOW})")
    args = parser.parse_args()
    windows = sorted({int(w) for w in args.windows.split(",") if w.strip()})
    result = BenchResult("loop_false_positives", "Closing constrained loops: false positives on real files",
                         args={"model": args.model, "tokens": args.tokens, "windows": windows,
                               "exact_window": EXACT_WINDOW})
    with recorded(result, args.json):
        read, fired = array_rule(json_files())
        print(f"# array rule: {len(fired)} of {read} JSON files")
        for line in fired:
            print(f"#   {line}")
        result.metric("array rule", "JSON files read", read, "files")
        result.metric("array rule", "files where it fires", len(fired), "files", better="lower")
        result.notes += [f"array rule fired: {line}" for line in fired]
        tokenizer = tokenizer_of(model_folder(args.model, args.cache_dir))
        by_window = exact_guard(tokenizer, windows, args.tokens)
        files = len(corpus_files())
        rows = [["array rule (JSON files)", read, len(fired)]]
        for window, hits in by_window.items():
            marker = " (the engine's)" if window == EXACT_WINDOW else ""
            rows.append([f"exact guard, window {window}{marker} (source files as JSON strings)", files, len(hits)])
            result.metric("exact guard", f"window {window}: files where it fires", len(hits), "files",
                          better="lower")
            result.notes += [f"window {window} fired: {line}" for line in hits]
            print(f"# exact guard at {window}: {len(hits)} of {files}")
            for line in hits[:20]:
                print(f"#   {line}")
    print_table(["rule", "files", "fires on"], rows)


if __name__ == "__main__":
    sys.exit(main())
