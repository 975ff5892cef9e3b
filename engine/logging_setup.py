"""Process-wide logging: readable lines on a terminal, JSON lines for --serve."""

from __future__ import annotations

import json
import logging
import sys
import time
from logging.handlers import RotatingFileHandler
from pathlib import Path

from engine.store.private_dirs import make_private_dir

LOG_FILE_BYTES = 10 * 2**20

# uvicorn's color_message repeats msg with ANSI escapes: noise in JSON lines.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "color_message"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, plus any ``extra`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        payload = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        payload.update({k: v for k, v in vars(record).items() if k not in _STANDARD and v is not None})
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return json.dumps(payload, default=str)


def configure_logging(level: str = "info", json_lines: bool = False, stream=None, file: Path | None = None) -> None:
    """Log to ``file`` (rotating) when given — the workbench owns the terminal — else to ``stream``."""
    if file is not None:
        make_private_dir(file.parent)
        handler: logging.Handler = RotatingFileHandler(file, maxBytes=LOG_FILE_BYTES, backupCount=3, encoding="utf-8")
    else:
        handler = logging.StreamHandler(stream or sys.stderr)
    if json_lines:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Libraries' per-request chatter drowns the engine's own events.
    for noisy in ("httpx", "httpcore", "urllib3", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class _RankTag(logging.Filter):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def tag_logs_with_rank(rank: int) -> None:
    """Under mlx.launch every rank's lines reach one terminal: each line says which rank wrote it."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(_RankTag(rank))
        if not isinstance(handler.formatter, JsonFormatter):
            handler.setFormatter(logging.Formatter(f"%(asctime)s r{rank} %(levelname)-7s %(name)s: %(message)s",
                                                   "%H:%M:%S"))
