"""The byte tokenizer plus a few special tokens (reasoning markers, harmony's message markup), one id each.

For the scripted engine and unit tests of the reasoning split: text is bytes
as in ``ByteTokenizer``, and each special string is one token after EOS,
encoded whole wherever it appears and decoded back to its text, as a real
tokenizer's added tokens are. It answers mlx-lm's thinking facts
(``has_thinking``, ``think_start_tokens``...) when its specials include
``<think>``/``</think>``, and ``get_vocab`` for harmony's detection.
"""

from __future__ import annotations

import json
import re

from .byte_tokenizer import BOS, EOS, ByteDetokenizer, ByteTokenizer

THINK = ("<think>", "</think>")
HARMONY = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>", "<|return|>", "<|constrain|>")


class MarkerDetokenizer(ByteDetokenizer):
    def __init__(self, specials: dict[int, str]) -> None:
        self.specials = specials
        super().__init__()

    def add_token(self, token: int) -> None:
        if token in self.specials:
            self.tokens.append(token)
            self._segment += self._decoder.decode(b"", final=True) + self.specials[token]
        else:
            super().add_token(token)


class MarkerTokenizer(ByteTokenizer):
    has_chat_template = True

    def __init__(self, specials: tuple[str, ...] = THINK, stop: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.special_ids = {text: EOS + 1 + i for i, text in enumerate(specials)}
        self.special_texts = {i: text for text, i in self.special_ids.items()}
        self.eos_token_ids = {EOS, *(self.special_ids[s] for s in stop)}
        self._split = re.compile("(" + "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)) + ")")
        self.tokens = [*ByteTokenizer.tokens, *(t.encode() for t in specials)]

    @property
    def vocab_size(self) -> int:
        return EOS + 1 + len(self.special_ids)

    def get_vocab(self) -> dict[str, int]:
        return {**{chr(i): i for i in range(256)}, "<s>": BOS, "</s>": EOS, **self.special_ids}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = []
        for part in self._split.split(text):
            ids += [self.special_ids[part]] if part in self.special_ids else list(part.encode("utf-8"))
        return [BOS, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int]) -> str:
        out, run = [], []
        for i in ids:
            if i in self.special_texts:
                out.append(bytes(run).decode("utf-8", errors="replace") + self.special_texts[i])
                run = []
            elif i < 256:
                run.append(i)
        return "".join(out) + bytes(run).decode("utf-8", errors="replace")

    @property
    def detokenizer(self) -> MarkerDetokenizer:
        return MarkerDetokenizer(self.special_texts)

    # mlx-lm's TokenizerWrapper facts about thinking (its _infer_thinking finds <think>/</think> in the vocabulary).
    @property
    def has_thinking(self) -> bool:
        return all(t in self.special_ids for t in THINK)

    @property
    def think_start(self) -> str | None:
        return THINK[0] if self.has_thinking else None

    @property
    def think_end(self) -> str | None:
        return THINK[1] if self.has_thinking else None

    @property
    def think_start_tokens(self) -> tuple[int, ...] | None:
        return (self.special_ids[THINK[0]],) if self.has_thinking else None

    @property
    def think_end_tokens(self) -> tuple[int, ...] | None:
        return (self.special_ids[THINK[1]],) if self.has_thinking else None

    def apply_chat_template(self, messages, tokenize: bool = True, add_generation_prompt: bool = True, **kwargs):
        """ByteTokenizer's transcript, with each assistant turn's reasoning when the message carries one, and the
        generation prompt opening the reasoning unless ``enable_thinking`` is false (Qwen3.5's pattern); with
        harmony's specials, harmony messages (gpt-oss's pattern, in short)."""
        if "<|channel|>" in self.special_ids:
            return self._harmony(messages, tokenize, add_generation_prompt)
        parts = []
        for m in messages:
            reasoning = m.get("reasoning_content")
            body = f"<think>{reasoning}</think>{m['content']}" if reasoning and self.has_thinking else m["content"]
            parts.append(f"<{m['role']}>{body}\n")
        text = "".join(parts)
        if add_generation_prompt:
            text += "<assistant>"
            if self.has_thinking:
                text += "<think>" if kwargs.get("enable_thinking", True) else "<think></think>"
        return self.encode(text) if tokenize else text

    def _harmony(self, messages, tokenize: bool, add_generation_prompt: bool):
        parts = []
        for m in messages:
            if m["role"] != "assistant":
                parts.append(f"<|start|>{m['role']}<|message|>{m['content']}<|end|>")
                continue
            if m.get("thinking"):
                parts.append(f"<|start|>assistant<|channel|>analysis<|message|>{m['thinking']}<|end|>")
            for call in m.get("tool_calls") or ():
                function = call["function"]
                parts.append(f"<|start|>assistant to=functions.{function['name']}<|channel|>commentary json"
                             f"<|message|>{json.dumps(function['arguments'])}<|call|>")
            if m["content"]:
                parts.append(f"<|start|>assistant<|channel|>final<|message|>{m['content']}<|end|>")
        text = "".join(parts) + ("<|start|>assistant" if add_generation_prompt else "")
        return self.encode(text) if tokenize else text
