"""The top line: model, HTTP address (for ANTHROPIC_BASE_URL), engine status, memory against its watermarks,
a slow BLAS while it lasts, and (attached) a lost link to the server while it lasts."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widgets import Static

from engine.runtime.engine_thread.snapshot import EngineSnapshot, ModelView


def memory_part(memory: dict) -> tuple[str, str]:
    """The machine's memory in use against the soft watermark; under pressure, what the engine does about it."""
    gib = 2**30
    used, total = memory["system_used_bytes"] / gib, memory["system_total_bytes"] / gib
    soft, hard = memory["soft_watermark_bytes"] / gib, memory["hard_watermark_bytes"] / gib
    if memory["pressure"] == "hard":
        return f"MEMORY {used:.1f}/{total:.1f} GiB > hard {hard:.1f}: refusing new requests", "bold reverse red"
    if memory["pressure"] == "soft":
        return f"MEMORY {used:.1f}/{total:.1f} GiB > soft {soft:.1f}: sending idle agents away", "bold reverse yellow"
    return f"mem {used:.1f}/{total:.1f} GiB (soft {soft:.1f})", "dim"


class StatusBar(Static):
    DEFAULT_CSS = """
    StatusBar { height: 1; background: $panel; color: $foreground; padding: 0 1; }
    """
    url: reactive[str | None] = reactive(None)
    phase: reactive[str] = reactive("loading model")
    stalled_s: reactive[float | None] = reactive(None)
    link: reactive[str | None] = reactive(None)  # attached: why the picture is not live

    def __init__(self, *, id: str | None = None, blas_warning: str | None = None) -> None:
        super().__init__(id=id)
        self._snapshot: EngineSnapshot | None = None
        # Shown until fixed: MLX's CPU matmul on its bundled reference BLAS makes everything ~30x slower.
        self.blas_warning = blas_warning

    def update_snapshot(self, snapshot: EngineSnapshot) -> None:
        self._snapshot = snapshot
        self.phase = snapshot.status
        self.refresh()

    def render(self) -> Text:
        parts: list[tuple[str, str]] = [("semantic", "bold")]
        snap = self._snapshot
        if snap is not None and snap.model is not None:
            parts.append((model_part(snap.model), "bold"))
        parts.append((self.url or "HTTP starting…", "underline" if self.url else "dim"))
        if self.link is not None:
            parts.append((self.link, "bold reverse yellow"))
        elif self.stalled_s is not None:
            parts.append((f"ENGINE STALLED {self.stalled_s:.0f} s", "bold reverse red"))
        else:
            parts.append((self.phase, "green" if self.phase == "ready" else "yellow"))
        if self.blas_warning:
            parts.append((self.blas_warning, "bold reverse red"))
        if snap is not None and snap.memory:
            parts.append(memory_part(snap.memory))
        if snap is not None:
            busy = sum(a.state != "idle" for a in snap.agents)
            parts.append((f"{len(snap.agents)} agents · {busy} busy · batch {snap.throughput.batch_size}", "dim"))
        return Text(" · ").join(Text(text, style=style) for text, style in parts)


def model_part(model: ModelView) -> str:
    """The loaded model, its family and context, and the draft model drafting for it, if any."""
    text = f"{model.model_id} ({model.architecture}, ctx {model.context_length:,})"
    draft = model.speculation.removeprefix("draft model ")
    return f"{text} + draft {draft}" if draft != model.speculation else text
