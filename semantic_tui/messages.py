"""Typed messages the workbench's workers post to the app.

Workers never touch widgets; they post these. Progress messages coalesce
(``can_replace``), so a fast producer never floods the message queue.
"""

from __future__ import annotations

from typing import Any

from textual.message import Message

from engine.models.gguf_import import ImportProgress


class LoadProgress(Message):
    def __init__(self, progress: ImportProgress) -> None:
        super().__init__()
        self.progress = progress

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, LoadProgress) and message.progress.stage == self.progress.stage


class ModelReady(Message):
    def __init__(self, engine: Any) -> None:
        super().__init__()
        self.engine = engine


class ModelFailed(Message):
    def __init__(self, title: str, detail: str) -> None:
        super().__init__()
        self.title = title
        self.detail = detail


class EngineStopped(Message):
    """The engine finished shutting down (caches persisted)."""
