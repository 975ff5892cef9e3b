"""A non-streamed chat turn run to its end: what the Anthropic, OpenAI chat and Responses routes share.

Each protocol then writes its own body from the pieces (text, reasoning,
tool calls) and the finish event; a turn that failed answers with the HTTP
error of its failure, the same for all three (``admission.finish_error``).
"""

from __future__ import annotations

from typing import Awaitable, Callable

from engine.domain.requests import FinishEvent
from engine.formats.tools.calls import Piece

from .admission import failed, finish_error
from .async_turn import AsyncTurn
from .turns import OutputAssembler


async def run_to_end(turn: AsyncTurn, assembler: OutputAssembler, disconnected: Callable[[], Awaitable[bool]],
                     observe: Callable[[FinishEvent], None]) -> tuple[FinishEvent, list[Piece]]:
    """The turn's finish event and every piece the assembler made of its events (``observe`` sees the finish
    first: the protocol's metrics). Raises the failure's ApiError for a turn that failed or was cancelled;
    a client that leaves, or a handler cancelled itself, cancels the turn."""
    try:
        events = await turn.run_to_finish(disconnected)
    finally:
        turn.cancel()  # (a no-op once the turn has finished)
    finish = turn.finish
    assert finish is not None, "run_to_finish returns once the finish event has arrived"
    observe(finish)
    if failed(finish):
        raise finish_error(finish)
    pieces = [piece for event in events for piece in assembler.feed(event)]
    return finish, pieces + assembler.finish()
