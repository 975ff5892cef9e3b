"""Which of the project's files one plain Anthropic turn runs code in, and how many lines they hold.

A tiny random-weight Llama (tests/support/tiny_models.py) behind the real app and a real Engine, in one
process; one non-streaming ``POST /v1/messages`` (a warm-up turn first, so lazy imports and first-use
set-up are not counted); every thread traced while the request runs (``sys.settrace`` and
``threading.settrace``). Prints the files under engine/ by layer and the total, the count issue 50 asks
for ("files a plain Anthropic turn touches").

Run: ``python -m bench.turn_files`` from the repository root (``--list`` prints every file).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def touched_by_one_turn() -> set[Path]:
    import httpx

    from engine.api.app import create_app
    from engine.runtime.engine_thread.engine import Engine
    from tests.support.engine_settings import engine_settings
    from tests.support.router_app import make_service
    from tests.support.tiny_models import loaded_tiny

    seen: set[Path] = set()
    engine_dir = str(ROOT / "engine")

    def tracer(frame, event, arg):  # noqa: ANN001 - the settrace protocol
        filename = frame.f_code.co_filename
        if filename.startswith(engine_dir):
            seen.add(Path(filename))
        return None  # calls only: which files ran, not which lines

    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Say hello."}]}
    with tempfile.TemporaryDirectory() as scratch:
        engine = Engine(loaded_tiny("llama"), engine_settings(64 << 20, 4, 32))
        engine.start()
        try:
            app = create_app(make_service(Path(scratch), engine))  # type: ignore[arg-type]

            async def send() -> None:
                transport = httpx.ASGITransport(app)
                async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                    warm = await client.post("/v1/messages", json=body)
                    assert warm.status_code == 200, warm.text
                    threading.settrace(tracer)
                    sys.settrace(tracer)
                    engine.call(lambda e: sys.settrace(tracer)).result()
                    try:
                        reply = await client.post("/v1/messages", json={**body, "messages": [
                            *body["messages"], {"role": "assistant", "content": warm.json()["content"][0]["text"]},
                            {"role": "user", "content": "Again."}]})
                    finally:
                        sys.settrace(None)
                        threading.settrace(None)  # type: ignore[arg-type]
                        engine.call(lambda e: sys.settrace(None)).result()
                    assert reply.status_code == 200, reply.text

            asyncio.run(send())
        finally:
            engine.stop()
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print every file, with its lines")
    args = parser.parse_args()
    files = sorted(touched_by_one_turn())
    rooms = Counter(str(f.relative_to(ROOT).parent) for f in files)
    lines = {f: len(f.read_text().splitlines()) for f in files}
    for room, n in sorted(rooms.items()):
        print(f"{n:4d}  {room}")
    print(f"{len(files):4d}  files, {sum(lines.values()):,} lines")
    if args.list:
        for f in files:
            print(f"      {f.relative_to(ROOT)} ({lines[f]})")


if __name__ == "__main__":
    main()
