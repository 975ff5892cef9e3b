"""A byte-level tokenizer for unit tests: ids 0-255 are bytes, then BOS and EOS.

It behaves like mlx-lm's TokenizerWrapper where the engine touches it:
``encode``, ``decode``, ``detokenizer``, ``eos_token_ids``. Its detokenizer
only emits complete UTF-8 characters, like the real streaming detokenizers.
"""

from __future__ import annotations

import codecs

BOS = 256
EOS = 257
VOCAB_SIZE = 258


class ByteDetokenizer:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._segment = ""
        self.tokens: list[int] = []

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        self._segment += self._decoder.decode(bytes([token]) if token < 256 else b"")

    def finalize(self) -> None:
        self._segment += self._decoder.decode(b"", final=True)

    @property
    def last_segment(self) -> str:
        segment, self._segment = self._segment, ""
        return segment


class ByteTokenizer:
    eos_token_id = EOS
    bos_token_id = BOS

    def __init__(self) -> None:
        self.eos_token_ids = {EOS}

    # What llguidance's TokenizerWrapper reads (structured outputs): every token's bytes, and encoding bytes.
    tokens = [bytes([i]) for i in range(256)] + [b"<s>", b"</s>"]
    special_token_ids = [BOS, EOS]

    def __len__(self) -> int:  # (as TokenizerWrapper's: every id it knows, special ones included)
        return VOCAB_SIZE

    def __call__(self, data: bytes) -> list[int]:
        return list(data)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    @property
    def detokenizer(self) -> ByteDetokenizer:
        return ByteDetokenizer()

    def apply_chat_template(self, messages, tokenize: bool = True, add_generation_prompt: bool = True, **_):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "<assistant>"
        return self.encode(text) if tokenize else text
