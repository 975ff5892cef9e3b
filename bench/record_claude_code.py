"""Record the requests the real Claude Code CLI sends, as a user runs it (no ``--bare``).

Starts a small capture server on a loopback port that answers every
``POST /v1/messages`` with a short, valid Messages stream (so the CLI ends its
turn and exits), runs ``claude -p PROMPT`` against it with only
ANTHROPIC_BASE_URL and a key set, and writes every request it sent (path,
headers without secrets, body) to a JSONL file. The recorded bodies are what
the Claude Code benchmarks replay: ~12-15K tokens of system prompt and tools.

Run: ``python -m bench.record_claude_code --out bench/traces/claude_code_full.jsonl [--prompt TEXT]``.
The CLI comes from the same npm install the end-to-end test uses.

``--tool-turns`` records a session with tool-result turns: the project holds
two source files, and the capture server answers the CLI's main requests (the
ones that carry its tools) with a ``Read`` call for each file in turn, then a
short text. The CLI runs the tools itself, so every request after the first
carries its real tool results, growing the conversation as a coding agent's
does; only the assistant's words are scripted.

``--write-turn FILE...`` records one session per file, a copy-heavy turn as
a coding agent makes it: the project holds the file (a source of this
repository, cut at a line end to about ``--max-chars``), the user asks for a
rename across it, and the capture server answers with a ``Read`` of the file
and then a ``Write`` of it whole with the rename made. The request after the
``Read`` (system prompt, tools, the ask and the file as the CLI's ``Read``
returned it, with line numbers) is the one whose answer is that ``Write``:
``bench/bench_speculation.py`` replays it to time a model writing the file
back. The CLI runs as a user runs it, without permission flags, so it asks
for permission for the ``Write`` and gets none; the recorded turn comes
before that.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.model.claude_code_cli import install_claude_code, npm_prefix  # noqa: E402
from bench.trace_format import tool_results  # noqa: E402

SECRET_HEADERS = {"x-api-key", "authorization", "cookie"}
REPLY = "Red."


def sse(event: dict) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


def canned_stream(model: str, tool_call: dict | None = None) -> bytes:
    """A short Messages stream: the text REPLY, or (``tool_call``: id, name, input) one tool call."""
    usage = {"input_tokens": 1, "output_tokens": 1, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    if tool_call is None:
        block = [{"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                 {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": REPLY}}]
    else:
        block = [{"type": "content_block_start", "index": 0,
                  "content_block": {"type": "tool_use", "id": tool_call["id"], "name": tool_call["name"],
                                    "input": {}}},
                 {"type": "content_block_delta", "index": 0,
                  "delta": {"type": "input_json_delta", "partial_json": json.dumps(tool_call["input"])}}]
    events = [
        {"type": "message_start", "message": {"id": "msg_recorder", "type": "message", "role": "assistant",
                                              "model": model, "content": [], "stop_reason": None,
                                              "stop_sequence": None, "usage": usage}},
        *block,
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn" if tool_call is None else "tool_use",
                                            "stop_sequence": None},
         "usage": {"output_tokens": 1}},
        {"type": "message_stop"},
    ]
    return b"".join(sse(e) for e in events)


# The --tool-turns project: files a coding agent would read before answering (a few hundred tokens each).
PROJECT_FILES = {
    "inventory.py": '''"""Stock levels for a small shop: items, counts and reorder points."""

from dataclasses import dataclass, field


@dataclass
class Item:
    sku: str
    name: str
    count: int = 0
    reorder_at: int = 5

    def needs_reorder(self) -> bool:
        return self.count <= self.reorder_at


@dataclass
class Inventory:
    items: dict[str, Item] = field(default_factory=dict)

    def add(self, item: Item) -> None:
        if item.sku in self.items:
            raise ValueError(f"duplicate sku {item.sku}")
        self.items[item.sku] = item

    def take(self, sku: str, n: int = 1) -> int:
        item = self.items[sku]
        if n > item.count:
            raise ValueError(f"only {item.count} of {item.name} left")
        item.count -= n
        return item.count

    def to_reorder(self) -> list[Item]:
        return sorted((i for i in self.items.values() if i.needs_reorder()), key=lambda i: i.count)
''',
    "test_inventory.py": '''import pytest

from inventory import Inventory, Item


def test_take_lowers_the_count():
    shop = Inventory()
    shop.add(Item("A1", "apples", count=10))
    assert shop.take("A1", 3) == 7


def test_taking_more_than_there_is_raises():
    shop = Inventory()
    shop.add(Item("B2", "bread", count=1))
    with pytest.raises(ValueError, match="only 1 of bread left"):
        shop.take("B2", 2)


def test_to_reorder_lists_low_items_lowest_first():
    shop = Inventory()
    shop.add(Item("A1", "apples", count=10))
    shop.add(Item("B2", "bread", count=2))
    shop.add(Item("C3", "cheese", count=4))
    assert [i.sku for i in shop.to_reorder()] == ["B2", "C3"]
''',
}
TOOL_TURNS_PROMPT = "Read inventory.py and test_inventory.py, then tell me whether the tests cover take()."


def write_turn_file(path: Path, max_chars: int) -> tuple[str, str]:
    """A --write-turn source: its text cut at a line end to at most ``max_chars``, and the name to rename (its
    first top-level def or class)."""
    kept, size = [], 0
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        if size + len(line) > max_chars:
            break
        kept.append(line)
        size += len(line)
    text = "".join(kept)
    names = re.findall(r"^(?:def|class) (\w+)", text, flags=re.M)
    if not names:
        raise SystemExit(f"{path}: no top-level def or class in its first {max_chars} characters to rename")
    return text, names[0]


def write_turn_prompt(name: str, old: str) -> str:
    return f"In {name}, rename `{old}` to `{old}_renamed` everywhere, and write the whole file back."


def scripted_write_turn(payload: dict, target: Path, old: str) -> dict | None:
    """The --write-turn script for one request: a Read of ``target``, then a Write of it with ``old`` renamed,
    then text; None too for a request without the CLI's tools (a title, a probe)."""
    if not any(tool.get("name") == "Write" for tool in payload.get("tools") or []):
        return None
    results = tool_results(payload)
    if results == 0:
        return {"id": "toolu_recorder_read", "name": "Read", "input": {"file_path": str(target)}}
    if results == 1:
        edited = re.sub(rf"\b{re.escape(old)}\b", f"{old}_renamed", target.read_text(encoding="utf-8"))
        return {"id": "toolu_recorder_write", "name": "Write", "input": {"file_path": str(target), "content": edited}}
    return None


def scripted_tool_call(payload: dict, project: Path) -> dict | None:
    """The --tool-turns script for one request: a Read of the next project file not read yet, or None (answer
    in text) once all are read or for a request without the CLI's tools (a title, a probe)."""
    if not any(tool.get("name") == "Read" for tool in payload.get("tools") or []):
        return None
    results = tool_results(payload)
    names = sorted(PROJECT_FILES)
    if results >= len(names):
        return None
    return {"id": f"toolu_recorder_{results}", "name": "Read", "input": {"file_path": str(project / names[results])}}


class Recorder(BaseHTTPRequestHandler):
    records: list[dict] = []
    lock = threading.Lock()
    project: Path | None = None  # --tool-turns: the project whose files the script has the CLI read
    write_target: tuple[Path, str] | None = None  # --write-turn: the file the script reads and writes, the name

    def log_message(self, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:
        self.send_response(200)
        self.end_headers()

    def do_GET(self) -> None:
        self._record(b"")
        self._json({"data": [], "has_more": False})

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        self._record(body)
        if self.path.startswith("/v1/messages/count_tokens"):
            self._json({"input_tokens": 1})
            return
        payload = json.loads(body or b"{}")
        if self.write_target is not None:
            tool_call = scripted_write_turn(payload, *self.write_target)
        else:
            tool_call = scripted_tool_call(payload, self.project) if self.project is not None else None
        if payload.get("stream"):
            data = canned_stream(payload.get("model", "claude"), tool_call)
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        content = ([{"type": "text", "text": REPLY}] if tool_call is None
                   else [{"type": "tool_use", **tool_call}])
        self._json({"id": "msg_recorder", "type": "message", "role": "assistant", "model": payload.get("model"),
                    "content": content, "stop_reason": "end_turn" if tool_call is None else "tool_use",
                    "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}})

    def _record(self, body: bytes) -> None:
        headers = {k.lower(): v for k, v in self.headers.items() if k.lower() not in SECRET_HEADERS}
        with self.lock:
            self.records.append({"method": self.command, "path": self.path, "headers": headers,
                                 "body": json.loads(body) if body.startswith(b"{") else None})

    def _json(self, value: dict) -> None:
        data = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="JSONL file to write the requests to")
    parser.add_argument("--prompt", default=None, help="what the user types (default: 'Name one colour.', or "
                                                       "with --tool-turns a request to read the project's files)")
    parser.add_argument("--bare", action="store_true", help="record a --bare run instead")
    parser.add_argument("--model", default=None,
                        help="claude --model MODEL (e.g. haiku: a session on Claude Code's haiku tier, the side "
                             "requests bench_two_models' trace workload routes to a second model)")
    parser.add_argument("--tool-turns", action="store_true",
                        help="script Read calls of the project's two files before the answer (requests with tool "
                             "results)")
    parser.add_argument("--write-turn", nargs="+", type=Path, metavar="FILE",
                        help="one session per FILE: a rename asked for, a Read of the file and a Write of it "
                             "back scripted (the copy-heavy turn bench_speculation replays)")
    parser.add_argument("--max-chars", type=int, default=4000,
                        help="--write-turn: cut each file at a line end to at most this many characters "
                             "(default 4000, about 1K tokens of Python)")
    args = parser.parse_args()
    if args.write_turn and (args.tool_turns or args.prompt):
        parser.error("--write-turn makes its own project and prompt; leave out --tool-turns and --prompt")
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    binary = install_claude_code(npm_prefix())
    failures = 0
    if args.write_turn:
        for source in args.write_turn:
            text, old = write_turn_file(source, args.max_chars)
            with tempfile.TemporaryDirectory() as project:
                target = Path(project).resolve() / source.name
                target.write_text(text, encoding="utf-8")
                Recorder.write_target = (target, old)
                failures += _run_cli(binary, server, Path(project), write_turn_prompt(source.name, old), args.bare,
                                     args.model)
    else:
        prompt = args.prompt or (TOOL_TURNS_PROMPT if args.tool_turns else "Name one colour.")
        with tempfile.TemporaryDirectory() as project:
            if args.tool_turns:
                Recorder.project = Path(project).resolve()
                for name, text in PROJECT_FILES.items():
                    (Path(project) / name).write_text(text)
            failures += _run_cli(binary, server, Path(project), prompt, args.bare, args.model)
    server.shutdown()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as out:
        for record in Recorder.records:
            out.write(json.dumps(record) + "\n")
    sizes = [len(json.dumps(r["body"])) for r in Recorder.records if r["body"]]
    print(f"{len(Recorder.records)} requests recorded to {args.out} (bodies {sizes} bytes); "
          f"{failures} CLI run(s) exited non-zero")


def _run_cli(binary: Path, server: ThreadingHTTPServer, project: Path, prompt: str, bare: bool,
             model: str | None = None) -> int:
    """One ``claude -p PROMPT`` in ``project`` against the capture server, with only the base URL and a key set;
    1 when it exited non-zero (its output printed), else 0."""
    with tempfile.TemporaryDirectory() as home:
        env = {"PATH": os.environ.get("PATH", ""), "HOME": home, "LANG": "C.UTF-8",
               "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{server.server_port}", "ANTHROPIC_API_KEY": "any",
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
        argv = [str(binary), *(["--bare"] if bare else []), *(["--model", model] if model else []), "-p", prompt]
        done = subprocess.run(argv, cwd=project, env=env, capture_output=True, text=True, timeout=300,
                              stdin=subprocess.DEVNULL)
    print(f"claude -p {prompt!r}: exited {done.returncode}")
    if done.returncode != 0:
        print(f"claude stdout:\n{done.stdout}\nclaude stderr:\n{done.stderr}")
    return int(done.returncode != 0)


if __name__ == "__main__":
    main()
