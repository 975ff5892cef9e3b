"""What an admitted turn starts with: its sequence for the batch (sampler, end tokens, output constraint,
reasoning tracker), its text stream and its repetition guard.

Model facts only (the tokenizer, its end tokens, the output grammars, the
reasoning format): nothing here touches the pool or the queues.
"""

from __future__ import annotations

from typing import Any

from engine.domain.images import images_from
from engine.domain.rotary_positions import ImagePositions
from engine.domain.reasoning import ReasoningFormat
from engine.domain.reasoning_tracker import ReasoningTracker, start_tracker
from engine.domain.requests import GenerationRequest
from engine.grammar.output_grammars import OutputGrammars
from engine.runtime.runner.leading_blank import LeadingBlankKept
from engine.runtime.runner.routed_text import RoutedText
from engine.runtime.runner.sampling import build_sampler
from engine.runtime.runner.sequence import Sequence
from engine.domain.repetition import RepetitionGuard
from engine.runtime.scheduler.turn import Turn


class TurnStart:
    def __init__(self, tokenizer: Any, eos: frozenset[int], repetition_window: int,
                 grammars: OutputGrammars | None = None, reasoning: ReasoningFormat | None = None) -> None:
        self.tokenizer = tokenizer
        self.eos = eos
        self.repetition_window = repetition_window
        self.grammars = grammars if grammars is not None else OutputGrammars(tokenizer, eos)  # structured outputs
        self.reasoning = reasoning  # how the model marks its reasoning (None: it does not)

    def sequence(self, uid: int, turn: Turn, checkpoint_at: tuple[int, ...]) -> Sequence:
        """The turn's sequence: its prompt past the reused tokens, on its prepared cache."""
        request, agent = turn.request, turn.agent
        assert agent is not None and turn.holder is not None and turn.holder.kv is not None
        k = turn.reused
        return Sequence(
            uid, turn.holder.kv, list(request.prompt_tokens[k:]), request.max_tokens,
            sampler=build_sampler(request.sampling),
            stop_tokens=self.eos,
            constraint=self.grammars.start(request.output_format) if request.output_format is not None else None,
            reasoning=self._reasoning(request),
            checkpoint_at=checkpoint_at,
            checkpoint_prompt_end=turn.on_own_cache,
            turn_checkpoint_at=request.reply_start if request.reply_start > k else 0,
            context=request.prompt_tokens[:k],
            images=images_from(request.images, k),
            positions=ImagePositions.of(request.images),
            owner=agent.agent_id,
        )

    def readers(self, request: GenerationRequest) -> tuple[RoutedText, RepetitionGuard]:
        """How the turn's tokens are read: text on its routes (stop strings held back), and the loop guard."""
        def detokenizer() -> Any:
            if request.plain_text:  # a raw completion continues its prompt mid-line: its leading blank is text
                return LeadingBlankKept(self.tokenizer.detokenizer, self.tokenizer.decode, request.prompt_tokens)
            return self.tokenizer.detokenizer

        text = RoutedText(detokenizer, request.stop_strings, request.turn_end_strings)
        return text, RepetitionGuard(self.repetition_window)

    def _reasoning(self, request: GenerationRequest) -> ReasoningTracker | None:
        """The turn's reasoning tracker: where the prompt leaves off (reasoning opened or not), with its budget."""
        if self.reasoning is None or request.plain_text:
            return None
        return start_tracker(self.reasoning, request.prompt_tokens, self.tokenizer.decode, request.reasoning_budget,
                             constrained=request.output_format is not None)
