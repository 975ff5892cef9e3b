"""The text the peer-comparison workloads send: deterministic, sized in real tokens, unique where it must be.

Coding agents look alike at the start of their context (one long system prompt
shared by every session of the same tool) and differ after it: each agent's
own task, then tool results and replies. The generators here reproduce that
shape so both servers get prompts with the same sharing structure as real
multi-agent runs.
"""

from __future__ import annotations

from tokenizers import Tokenizer

TOPICS = ("the ocean", "mountains", "a city at night", "a robot", "autumn", "a library", "trains", "the moon",
          "coffee", "a garden", "rain", "a lighthouse", "chess", "bees", "a desert", "snow")


def _grow(tokenizer: Tokenizer, head: list[str], line, n_tokens: int) -> str:
    """Append ``line(i)`` to ``head`` until the text is ``n_tokens`` long."""
    lines = list(head)
    while len(tokenizer.encode("\n".join(lines)).ids) < n_tokens:
        lines.append(line(len(lines)))
    return "\n".join(lines)


def shared_system_prompt(tokenizer: Tokenizer, n_tokens: int) -> str:
    """One coding-agent policy, the same for every agent, about ``n_tokens`` long."""
    return _grow(
        tokenizer,
        ["You are a coding agent working in a large Python repository.", "House rules:"],
        lambda i: (f"Rule {i}: functions in module m{i} stay under {10 + i * 7 % 90} lines, "
                   f"and every change there needs the test t{i} to pass."),
        n_tokens,
    )


def tool_result(tokenizer: Tokenizer, agent: int, turn: int, n_tokens: int) -> str:
    """A user turn as agent loops send them: a tool's output, different for every agent and turn."""
    return _grow(
        tokenizer,
        [f"Agent {agent}, step {turn + 1}: the test run printed this. Say which test to fix first and why."],
        lambda i: (f"tests/test_m{agent}_{turn}.py::test_case_{i} "
                   f"{'FAILED' if (agent + turn + i) % 3 == 0 else 'passed'} in {(agent * 7 + i * 13) % 97} ms"),
        n_tokens,
    )


def growing_document(tokenizer: Tokenizer, turn: int, n_tokens: int) -> str:
    """One long-context turn: the next part of a document the agent is reading, then a question."""
    return _grow(
        tokenizer,
        [f"Part {turn + 1} of the design notes follows. Summarise what changed in one sentence."],
        lambda i: (f"Section {turn + 1}.{i}: the cache for request class {turn * 50 + i} keeps "
                   f"{(turn * 31 + i * 17) % 1000} entries and expires after {(i * 11) % 60 + 1} minutes."),
        n_tokens,
    )


def story_request(n_streams: int, i: int) -> list[dict[str, str]]:
    """A single-turn prompt new to both servers: no cache on either side can serve it."""
    return [{"role": "user", "content": f"Story {n_streams}-{i}: write a long story about {TOPICS[i % len(TOPICS)]}."}]
