"""Record the requests the real Claude Code CLI sends, as a user runs it (no ``--bare``).

Starts a small capture server on a loopback port that answers every
``POST /v1/messages`` with a short, valid Messages stream (so the CLI ends its
turn and exits), runs ``claude -p PROMPT`` against it with only
ANTHROPIC_BASE_URL and a key set, and writes every request it sent (path,
headers without secrets, body) to a JSONL file. The recorded bodies are what
the Claude Code benchmarks replay: ~12-15K tokens of system prompt and tools.

Run: ``python bench/record_claude_code.py --out bench/traces/claude_code_full.jsonl [--prompt TEXT]``.
The CLI comes from the same npm install the end-to-end test uses.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.model.claude_code_cli import install_claude_code, npm_prefix  # noqa: E402

SECRET_HEADERS = {"x-api-key", "authorization", "cookie"}
REPLY = "Red."


def sse(event: dict) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


def canned_stream(model: str) -> bytes:
    usage = {"input_tokens": 1, "output_tokens": 1, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    events = [
        {"type": "message_start", "message": {"id": "msg_recorder", "type": "message", "role": "assistant",
                                              "model": model, "content": [], "stop_reason": None,
                                              "stop_sequence": None, "usage": usage}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": REPLY}},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
         "usage": {"output_tokens": 1}},
        {"type": "message_stop"},
    ]
    return b"".join(sse(e) for e in events)


class Recorder(BaseHTTPRequestHandler):
    records: list[dict] = []
    lock = threading.Lock()

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
        if payload.get("stream"):
            data = canned_stream(payload.get("model", "claude"))
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self._json({"id": "msg_recorder", "type": "message", "role": "assistant", "model": payload.get("model"),
                    "content": [{"type": "text", "text": REPLY}], "stop_reason": "end_turn", "stop_sequence": None,
                    "usage": {"input_tokens": 1, "output_tokens": 1}})

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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSONL file to write the requests to")
    parser.add_argument("--prompt", default="Name one colour.", help="what the user types")
    parser.add_argument("--bare", action="store_true", help="record a --bare run instead")
    args = parser.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    binary = install_claude_code(npm_prefix())
    with tempfile.TemporaryDirectory() as home, tempfile.TemporaryDirectory() as project:
        env = {"PATH": os.environ.get("PATH", ""), "HOME": home, "LANG": "C.UTF-8",
               "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{server.server_port}", "ANTHROPIC_API_KEY": "any",
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
        argv = [str(binary), *(["--bare"] if args.bare else []), "-p", args.prompt]
        done = subprocess.run(argv, cwd=project, env=env, capture_output=True, text=True, timeout=300,
                              stdin=subprocess.DEVNULL)
    server.shutdown()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as out:
        for record in Recorder.records:
            out.write(json.dumps(record) + "\n")
    sizes = [len(json.dumps(r["body"])) for r in Recorder.records if r["body"]]
    print(f"claude exited {done.returncode}; {len(Recorder.records)} requests recorded to {args.out} "
          f"(bodies {sizes} bytes)")


if __name__ == "__main__":
    main()
