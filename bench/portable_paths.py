"""A report names this machine's folders as a reader elsewhere can read them.

Reports are kept in the repository (bench/reports/), and a path such as a model folder a benchmark made
under /tmp, or the user's home, says nothing on another machine: the repository becomes ``.``, the
temporary folder ``$TMPDIR``, the home folder ``~``. ``BenchResult.write`` applies it to every JSON result;
``python -m bench.portable_paths FILE...`` rewrites kept logs and notes in place.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

REPOSITORY = Path(__file__).resolve().parents[1]


def portable(value: Any) -> Any:
    """``value`` with this machine's folders named as a reader elsewhere can read them: the repository as
    ``.``, the home folder as ``~``, the temporary folder as ``$TMPDIR``. A report is kept in the repository,
    and a model folder a benchmark made under /tmp says nothing on another machine."""
    if isinstance(value, str):
        for folder, name in ((REPOSITORY, "."), (Path(tempfile.gettempdir()), "$TMPDIR"), (Path.home(), "~")):
            value = _renamed(value, str(folder), name)
        return value
    if isinstance(value, dict):
        return {portable(k): portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [portable(v) for v in value]
    return value


def _renamed(text: str, folder: str, name: str) -> str:
    """Each ``folder`` at the start of a path in ``text`` (followed by ``/`` or the path's end) as ``name``."""
    if folder in ("", "/"):
        return text
    out, at = [], 0
    while (found := text.find(folder, at)) >= 0:
        end = found + len(folder)
        whole = end == len(text) or text[end] in "/\\\"' ,:;)]}\n"
        starts = found == 0 or not (text[found - 1].isalnum() or text[found - 1] in "._-")
        out.append(text[at:found] + (name if whole and starts else folder))
        at = end
    return "".join(out) + text[at:]


def rewrite(path: Path) -> bool:
    """``path`` with its machine folders renamed, written atomically; whether anything changed."""
    text = path.read_text()
    renamed = portable(text)
    if renamed == text:
        return False
    fd, partial = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as out:
        out.write(renamed)
    os.replace(partial, path)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.portable_paths", description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="text files to rewrite in place (logs, notes, JSON)")
    args = parser.parse_args(argv)
    for path in args.files:
        if rewrite(path):
            print(f"rewrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
