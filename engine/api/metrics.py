"""Prometheus metrics: request counters and histograms recorded by the API,
gauges read from the engine snapshot at scrape time.

Each app has its own CollectorRegistry, so two apps (tests, a model swap)
never share or double-register metrics.
"""

from __future__ import annotations

from typing import Any, Iterator

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from engine.domain.requests import FinishEvent
from engine.domain.speculation_tally import SpeculationTally
from engine.runtime.engine_thread.snapshot import EngineSnapshot, TierView

from .admin_routes import group_stats
from .live_stream import StreamHub
from .service import EngineService

router = APIRouter(tags=["observability"])

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
DURATION_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class MetricsRecorder:
    def __init__(self, service: EngineService) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("semantic_requests", "Requests by protocol and outcome",
                                ["protocol", "outcome"], registry=self.registry)
        self.generated = Counter("semantic_tokens_generated", "Generated tokens", registry=self.registry)
        self.prompt_tokens = Counter("semantic_prompt_tokens", "Prompt tokens by how they were served (reused from cache or prefilled)",
                                     ["kind"], registry=self.registry)
        self.ttft = Histogram("semantic_time_to_first_token_seconds", "Time to first token",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.duration = Histogram("semantic_request_duration_seconds", "Request duration",
                                  buckets=DURATION_BUCKETS, registry=self.registry)
        self.registry.register(SnapshotCollector(service))

    def observe(self, protocol: str, finish: FinishEvent | None, outcome: str | None = None) -> None:
        """Record one finished (or failed before starting) request."""
        if finish is None:
            self.requests.labels(protocol, outcome or "error").inc()
            return
        usage = finish.usage
        self.requests.labels(protocol, outcome or finish.reason.value).inc()
        self.generated.inc(usage.generated_tokens)
        self.prompt_tokens.labels("reused").inc(usage.reused_tokens)
        self.prompt_tokens.labels("prefilled").inc(usage.prefilled_tokens)
        if usage.ttft_s is not None:
            self.ttft.observe(usage.ttft_s)
        if usage.duration_s is not None:
            self.duration.observe(usage.duration_s)


Metrics = Iterator[GaugeMetricFamily | CounterMetricFamily]


class SnapshotCollector:
    """Gauges and engine-side counters, read from the latest engine snapshot."""

    def __init__(self, service: EngineService) -> None:
        self.service = service

    def collect(self) -> Metrics:
        snapshot = self.service.snapshot()
        yield GaugeMetricFamily("semantic_ready", "1 when a model is loaded and the engine runs",
                                value=1.0 if self.service.is_ready else 0.0)
        stalled = self.service.stalled_for()
        yield GaugeMetricFamily("semantic_engine_stalled_seconds",
                                "Seconds the engine has made no progress while work waits (0: fine)",
                                value=stalled or 0.0)
        yield CounterMetricFamily("semantic_engine_stalls", "Engine stalls seen by the watchdog",
                                  value=self.service.stalls_total)
        if self.service.models is not None:
            yield from _models(self.service.models.describe(), self.service.models.budget())
        if snapshot is None or snapshot.pool is None:
            return
        yield from _pool_and_agents(snapshot)
        yield from _speculation(snapshot.throughput.speculation)
        yield from _classes(snapshot)
        yield from _caches(snapshot.tiers)
        yield from _memory_and_ranks(snapshot)


class StreamCollector:
    """The live stream (GET /v1/stream): its clients, and what slow ones were not sent."""

    def __init__(self, hub: StreamHub) -> None:
        self.hub = hub

    def collect(self) -> Metrics:
        totals = self.hub.totals
        yield GaugeMetricFamily("semantic_stream_clients", "Clients of the live stream now", value=self.hub.subscribers)
        yield CounterMetricFamily("semantic_stream_stats_frames_built", "Stats frames built (once per tick for "
                                  "every client due)", value=totals.stats_built)
        dropped = CounterMetricFamily("semantic_stream_dropped_frames", "Frames a slow client never got: stats "
                                      "replaced by a newer one unsent, log events past its buffer", labels=["kind"])
        dropped.add_metric(["stats"], totals.stats_dropped)
        dropped.add_metric(["log"], totals.log_dropped)
        yield dropped
        yield CounterMetricFamily("semantic_stream_refused", "Stream clients refused at stream_max_clients",
                                  value=totals.refused)


def _pool_and_agents(snapshot: EngineSnapshot) -> Metrics:
    pool, tiers, throughput = snapshot.pool, snapshot.tiers, snapshot.throughput
    yield GaugeMetricFamily("semantic_pool_utilization_ratio", "Used share of the KV block pool", value=pool.pressure)
    yield _labelled_gauge("semantic_pool_blocks", "KV pool blocks", "state",
                          {"used": pool.used_blocks, "free": pool.free_blocks, "shared": pool.shared_blocks})
    yield GaugeMetricFamily("semantic_pool_bytes", "Bytes held by used KV blocks", value=pool.used_bytes)
    if snapshot.model is not None:
        groups = GaugeMetricFamily("semantic_pool_group_bytes", "Bytes of KV blocks held per layer group "
                                   "(cool agents' quantized blocks not included)", labels=["group", "kind"])
        for group in group_stats(pool, snapshot.model.spec, tiers.cool_bytes):
            groups.add_metric([str(group.index), group.kind], group.used_bytes)
        yield groups
    yield _labelled_gauge("semantic_agents", "Agents by cache tier", "tier",
                          {"hot": tiers.hot_agents, "warm": tiers.warm_agents, "cold": tiers.cold_agents})
    yield GaugeMetricFamily("semantic_agents_active", "Agents with a request queued or running",
                            value=sum(a.state != "idle" for a in snapshot.agents))
    yield GaugeMetricFamily("semantic_request_queue_depth", "Requests waiting for admission", value=throughput.queue_depth)
    yield GaugeMetricFamily("semantic_batch_size", "Sequences in the running batch", value=throughput.batch_size)
    yield GaugeMetricFamily("semantic_decode_tokens_per_second", "Aggregate decode rate", value=throughput.decode_tok_s)
    yield GaugeMetricFamily("semantic_prefill_tokens_per_second", "Aggregate prefill rate", value=throughput.prefill_tok_s)
    yield GaugeMetricFamily("semantic_warm_bytes", "Bytes of agent caches on disk", value=tiers.warm_bytes)


def _classes(snapshot: EngineSnapshot) -> Metrics:
    """Per agent class (docs/scheduling.md): recent time to first token and gaps between tokens, and the
    agents by class and the paused ones."""
    classes = snapshot.throughput.classes
    ttft = GaugeMetricFamily("semantic_class_ttft_seconds", "Recent time to first token per agent class (the "
                             "last 256 turns)", labels=["class", "quantile"])
    gaps = GaugeMetricFamily("semantic_class_token_gap_seconds", "Recent gaps between two tokens of a turn per "
                             "agent class (the last 2048)", labels=["class", "quantile"])
    for view in classes:
        for quantile, value in (("0.5", view.ttft_p50_s), ("0.95", view.ttft_p95_s)):
            if value is not None:
                ttft.add_metric([view.name, quantile], value)
        for quantile, value in (("0.5", view.gap_p50_s), ("0.95", view.gap_p95_s), ("1", view.gap_max_s)):
            if value is not None:
                gaps.add_metric([view.name, quantile], value)
    yield ttft
    yield gaps
    yield _class_turns(classes)
    counts: dict[str, float] = {}
    for agent in snapshot.agents:
        counts[agent.agent_class] = counts.get(agent.agent_class, 0) + 1
    yield _labelled_gauge("semantic_agents_by_class", "Agents per class", "class", counts)
    yield GaugeMetricFamily("semantic_agents_paused", "Agents the operator paused",
                            value=sum(a.paused for a in snapshot.agents))


def _class_turns(classes: Any) -> CounterMetricFamily:
    family = CounterMetricFamily("semantic_class_turns", "Turns that reached their first token, per agent class",
                                 labels=["class"])
    for view in classes:
        family.add_metric([view.name], view.turns)
    return family


def _speculation(speculation: SpeculationTally) -> Metrics:
    yield CounterMetricFamily("semantic_speculative_drafted_tokens", "Drafted tokens the model verified "
                              "(speculative decoding, finished turns)", value=speculation.drafted)
    yield CounterMetricFamily("semantic_speculative_accepted_tokens", "Drafted tokens kept: the ones the model "
                              "would have produced itself", value=speculation.accepted)
    yield CounterMetricFamily("semantic_speculative_steps", "Speculative steps that verified drafts",
                              value=speculation.steps)
    yield CounterMetricFamily("semantic_speculative_emitted_tokens", "Tokens those steps emitted (kept drafts "
                              "and the model's own token after them)", value=speculation.emitted)


def _caches(tiers: TierView) -> Metrics:
    evictions = CounterMetricFamily("semantic_evictions", "Agent evictions by target tier", labels=["tier"])
    for tier, count in sorted(tiers.evictions_total.items()):
        evictions.add_metric([tier], count)
    yield evictions
    yield CounterMetricFamily("semantic_cache_restores", "Warm caches restored into the pool", value=tiers.restores_total)
    hits = CounterMetricFamily("semantic_cache_hits", "Turns that reused a cached prefix, by where it came "
                               "from: the agent's own cache, or a prefix another agent held", labels=["source"])
    hits.add_metric(["own"], tiers.own_hits)
    hits.add_metric(["shared"], tiers.shared_hits)
    yield hits
    yield CounterMetricFamily("semantic_cache_misses", "Turns that prefilled their whole prompt", value=tiers.prefix_misses)
    outcomes = CounterMetricFamily(
        "semantic_turn_cache_outcomes", "Turns by how their prompt met the agent's cache: full, new_agent, "
        "shared, diverged, window, restored, dropped, model_changed, side_request, no_room", labels=["outcome"])
    for outcome, count in tiers.cache_outcomes:
        outcomes.add_metric([outcome], count)
    yield outcomes


def _memory_and_ranks(snapshot: EngineSnapshot) -> Metrics:
    if snapshot.memory:  # the memory watermarks (runtime/memory_pressure.py)
        memory = snapshot.memory
        yield _labelled_gauge("semantic_memory_bytes", "Memory the watermarks watch: the machine's in use "
                              "(system_used) and total, this process's footprint, MLX arrays and MLX's buffer "
                              "cache, and the soft and hard watermarks", "kind",
                              {"system_used": memory["system_used_bytes"], "system_total": memory["system_total_bytes"],
                               "process": memory["process_bytes"], "mlx_active": memory["mlx_active_bytes"],
                               "mlx_cache": memory["mlx_cache_bytes"], "soft_watermark": memory["soft_watermark_bytes"],
                               "hard_watermark": memory["hard_watermark_bytes"]})
        yield GaugeMetricFamily("semantic_memory_pressure", "0 normal, 1 past the soft watermark (idle agents "
                                "sent away), 2 past the hard one (new requests refused)",
                                value={"normal": 0, "soft": 1, "hard": 2}[str(memory["pressure"])])
    if snapshot.ranks:  # a sharded model (mlx.launch): each rank's MLX memory, as of the last tick
        yield _labelled_gauge("semantic_rank_memory_bytes", "MLX memory in use on each rank of a sharded model",
                              "rank", {str(r.rank): r.active_bytes for r in snapshot.ranks})


def _models(rows: list[dict[str, Any]], budget: dict[str, int]) -> Metrics:
    """With --extra-model: each configured model by alias (the families above are the default model's)."""
    resident = GaugeMetricFamily("semantic_model_resident", "1 while the model is loaded and serving",
                                 labels=["model", "role"])
    for row in rows:
        resident.add_metric([row["alias"], row["role"]], 1.0 if row["state"] == "resident" else 0.0)
    yield resident
    for name, key, doc in (("semantic_model_weights_bytes", "weights_bytes", "Bytes of the model's weights"),
                           ("semantic_model_kv_pool_bytes", "pool_bytes", "Bytes of the model's KV pool budget"),
                           ("semantic_model_kv_used_bytes", "kv_used_bytes", "Bytes its agents' caches hold"),
                           ("semantic_model_active_requests", "active_requests", "Requests it is serving")):
        yield _labelled_gauge(name, doc, "model", {row["alias"]: float(row[key]) for row in rows})
    routed = CounterMetricFamily("semantic_model_requests_routed", "Requests routed to the model", labels=["model"])
    waited = CounterMetricFamily("semantic_model_device_wait_seconds", "Seconds its engine waited for the device "
                                 "while another model's step ran", labels=["model"])
    for row in rows:
        routed.add_metric([row["alias"]], float(row["requests_routed"]))
        waited.add_metric([row["alias"]], float(row["device_wait_s"]))
    yield routed
    yield waited
    yield GaugeMetricFamily("semantic_models_budget_bytes", "models_budget_mb in bytes", value=budget["budget_bytes"])
    yield GaugeMetricFamily("semantic_models_held_bytes", "What the resident models hold of it (weights and KV "
                            "pools)", value=budget["held_bytes"])


def _labelled_gauge(name: str, doc: str, label: str, values: dict[str, float]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=[label])
    for key, value in values.items():
        family.add_metric([key], value)
    return family


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    recorder: MetricsRecorder = request.app.state.metrics
    return Response(generate_latest(recorder.registry), media_type=CONTENT_TYPE_LATEST)
