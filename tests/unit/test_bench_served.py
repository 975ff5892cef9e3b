"""bench/served.py: the line a benchmark prints about semantic's agents at the end of a run."""

from __future__ import annotations


import httpx
import pytest
from bench import served


pytestmark = pytest.mark.unit

MIB = 2**20


def _answer(agents: list[dict]) -> object:
    return lambda url, timeout: httpx.Response(200, json={"object": "list", "data": agents},
                                               request=httpx.Request("GET", url))


def test_a_hybrids_agents_report_their_snapshots_and_state(monkeypatch) -> None:
    agents = [{"bytes": 10 * MIB, "checkpoint_bytes": 20 * MIB, "state_bytes": 7 * MIB},
              {"bytes": 30 * MIB, "checkpoint_bytes": 40 * MIB, "state_bytes": 7 * MIB},
              {"bytes": 20 * MIB, "checkpoint_bytes": 0, "state_bytes": 7 * MIB}]
    monkeypatch.setattr(served.httpx, "get", _answer(agents))
    line = served.agent_cache_line("http://127.0.0.1:1")
    assert line == ("#   semantic agents at the end: 3, cache per agent median 20.0 MiB (max 30.0), "
                    "snapshots per agent median 20.0 MiB (max 40.0), recurrent state per agent median 7.0 MiB (max 7.0)")


def test_an_attention_models_agents_report_only_their_cache(monkeypatch) -> None:
    monkeypatch.setattr(served.httpx, "get", _answer([{"bytes": 4 * MIB, "checkpoint_bytes": 0, "state_bytes": 0}]))
    assert served.agent_cache_line("http://x") == "#   semantic agents at the end: 1, cache per agent median 4.0 MiB (max 4.0)"


def test_a_server_that_does_not_answer_is_said_so(monkeypatch) -> None:
    def refused(url, timeout):
        raise httpx.ConnectError("refused")

    monkeypatch.setattr(served.httpx, "get", refused)
    assert served.agent_cache_line("http://x").endswith("not read (ConnectError: refused)")
