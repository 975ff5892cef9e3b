"""The reasoning recall: a reply that comes back without its reasoning gets what this server recorded for it."""

from engine.formats.reasoning_recall import ReasoningRecall
from engine.domain.chat import ChatMessage, Conversation, ToolCall


def _reply(text: str = "", calls: tuple[ToolCall, ...] = (), reasoning: str = "") -> ChatMessage:
    return ChatMessage(role="assistant", content=text, tool_calls=calls, reasoning=reasoning)


def test_a_call_sent_back_under_another_id_and_key_order_is_the_same_reply() -> None:
    recall = ReasoningRecall()
    recall.remember("a", "", [ToolCall("toolu_1", "read", {"path": "x", "limit": 3})], "I should read x.")
    back = Conversation(messages=(ChatMessage(role="user", content="go"),
                                  _reply(calls=(ToolCall("call_9", "read", {"limit": 3, "path": "x"}),))))
    restored = recall.restore("a", back)
    assert restored.messages[1].reasoning == "I should read x."
    assert restored.messages[0] == back.messages[0]


def test_other_arguments_another_agent_or_a_reply_with_its_own_reasoning_are_left_alone() -> None:
    recall = ReasoningRecall()
    recall.remember("a", "Done.", [], "secret")
    assert recall.restore("a", Conversation(messages=(_reply("Done, mostly."),))).messages[0].reasoning == ""
    assert recall.restore("b", Conversation(messages=(_reply("Done."),))).messages[0].reasoning == ""
    own = Conversation(messages=(_reply("Done.", reasoning="mine"),))
    assert recall.restore("a", own) is own


def test_the_recall_is_bounded_least_recently_recorded_first_out() -> None:
    recall = ReasoningRecall(capacity=2)
    for n in range(3):
        recall.remember("a", f"reply {n}", [], f"thought {n}")
    assert len(recall) == 2
    assert recall.restore("a", Conversation(messages=(_reply("reply 0"),))).messages[0].reasoning == ""
    assert recall.restore("a", Conversation(messages=(_reply("reply 2"),))).messages[0].reasoning == "thought 2"
