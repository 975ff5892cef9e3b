"""A reply that comes back as the same text in other tokens keeps its cached tokens (scheduler/reply_splice.py),
on a toy vocabulary: the blank dropped at its start, trimmed at its end, and the cases that must stay as sent."""

from __future__ import annotations

from engine.domain.images import PromptImage
from engine.domain.requests import GenerationRequest
from engine.runtime.scheduler.reply_splice import spliced

VOCAB = {1: "<user>", 2: "Look", 3: "<bot>", 4: "<end>", 5: "<user>", 6: "More",
         10: " examines", 11: " the", 12: " image", 13: " picture", 14: ".\n",
         20: "examines", 21: "."}
HEAD = [1, 2, 3]  # the first turn's prompt, up to where the reply begins
REPLY = [10, 11, 12, 14]  # what the model wrote: " examines the image.\n"


def decode(ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


def request(prompt: list[int], **fields: object) -> GenerationRequest:
    return GenerationRequest("a", tuple(prompt), 8, **fields)  # type: ignore[arg-type]


def test_a_reply_back_without_its_leading_and_trailing_blanks_takes_the_cached_tokens() -> None:
    cached = HEAD + REPLY
    # the client's text "examines the image." tokenizes to other ids, then the next turn follows
    sent = request(HEAD + [20, 11, 12, 21] + [4, 5, 6], reply_start=9)
    kept = spliced(cached, sent, decode)
    assert kept is not None
    assert list(kept.prompt_tokens) == cached + [4, 5, 6]
    assert kept.reply_start == 9  # the spans are as long: nothing after them moved


def test_where_the_spans_differ_in_length_what_follows_moves_with_them() -> None:
    vocab_merged = {**VOCAB, 30: "examines the"}
    sent = request(HEAD + [30, 12, 21, 4, 5, 6], reply_start=8)
    kept = spliced(HEAD + REPLY, sent, lambda ids: "".join(vocab_merged[i] for i in ids))
    assert kept is not None and list(kept.prompt_tokens) == HEAD + REPLY + [4, 5, 6]
    assert kept.reply_start == 9


def test_a_reply_the_client_changed_is_prefilled_as_sent() -> None:
    sent = request(HEAD + [20, 11, 13, 21, 4, 5, 6])  # "examines the picture."
    assert spliced(HEAD + REPLY, sent, decode) is None


def test_a_prompt_that_follows_the_cache_or_parts_before_the_reply_is_left_alone() -> None:
    assert spliced(HEAD + REPLY, request(HEAD + REPLY + [4, 5, 6]), decode) is None
    assert spliced(HEAD + REPLY, request([1, 6, 3, 20, 11, 12, 21, 4, 5]), decode) is None


def test_the_prompt_keeps_a_token_of_its_own_to_prefill() -> None:
    kept = spliced(HEAD + REPLY, request(HEAD + [20, 11, 12, 21]), decode)
    assert kept is not None and list(kept.prompt_tokens) == HEAD + [10, 11, 12, 21]


def test_every_reply_of_a_conversation_comes_back_as_written_turn_after_turn() -> None:
    """The third turn's prompt holds two replies sent back as text: the cache (the second turn's prompt, which
    took the first reply's tokens, and the second reply) serves both."""
    second_reply = [10, 11, 13, 14]  # " examines the picture.\n"
    cached = HEAD + REPLY + [4, 5, 6, 3] + second_reply
    sent = request(HEAD + [20, 11, 12, 21] + [4, 5, 6, 3] + [20, 11, 13, 21] + [4, 5, 6, 3], reply_start=15)
    kept = spliced(cached, sent, decode)
    assert kept is not None and list(kept.prompt_tokens) == cached + [4, 5, 6, 3]
    assert kept.reply_start == 15


def test_an_image_after_a_replaced_stretch_moves_with_it_and_one_inside_stops_the_walk() -> None:
    vocab_merged = {**VOCAB, 30: "examines the"}
    after = PromptImage(start=7, length=1, key="k", digest="d", size_bytes=1, inputs={})
    sent = request(HEAD + [30, 12, 21, 4, 5, 6], images=(after,))
    kept = spliced(HEAD + REPLY, sent, lambda ids: "".join(vocab_merged[i] for i in ids))
    assert kept is not None and kept.images[0].start == 8
    inside = PromptImage(start=3, length=1, key="k", digest="d", size_bytes=1, inputs={})
    assert spliced(HEAD + REPLY, request(HEAD + [20, 11, 12, 21, 4, 5, 6], images=(inside,)), decode) is None
