"""Prometheus metrics of the server, named like vLLM's (prefix `tandem:`), in a registry per server.

Spec-decode counters and flywheel numbers are read at scrape time from the components that own them
(EngineStats, Flywheel.metrics(), HotSwapper stats): nothing on the engine's hot path updates Prometheus.
Request latency and time to first token are measured by the HTTP handlers (they include HTTP overhead).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)


class SpecDecodeCollector:
    """vLLM's spec-decode counters from the engine's running totals."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        stats = self.engine.stats
        for name, doc, value in (
            ("tandem:spec_decode_num_drafts", "Drafts verified (one per request per step with a non-empty draft).", stats.drafts),
            ("tandem:spec_decode_num_draft_tokens", "Drafted tokens verified.", stats.drafted_tokens),
            ("tandem:spec_decode_num_accepted_tokens", "Drafted tokens accepted by verification.", stats.accepted_tokens),
            ("tandem:spec_decode_num_emitted_tokens", "Tokens emitted by verify steps (accepted + recovered/bonus).", stats.emitted_tokens),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        per_pos = CounterMetricFamily("tandem:spec_decode_num_accepted_tokens_per_pos", "Accepted drafted tokens by draft position.", labels=["position"])
        for position, count in enumerate(list(stats.accepted_per_position)):
            per_pos.add_metric([str(position)], count)
        yield per_pos
        yield CounterMetricFamily("tandem:num_engine_steps", "Engine verify steps.", value=stats.steps)


class FlywheelCollector:
    """The flywheel's numbers: buffer, trainer, drafter version, swaps, refusals, rollbacks, alarms."""

    def __init__(self, swapper, flywheel=None):
        self.swapper, self.flywheel = swapper, flywheel

    def collect(self):
        swaps = self.swapper.stats
        yield GaugeMetricFamily("tandem:drafter_version", "Drafter weight version being served.", value=swaps.version)
        for name, doc, value in (
            ("tandem:drafter_swaps", "Drafter versions swapped in.", swaps.swaps),
            ("tandem:drafter_refusals", "Published drafter versions refused by validation.", swaps.refused),
            ("tandem:drafter_rollbacks", "Rollbacks to the last good drafter version.", swaps.rollbacks),
            ("tandem:drafter_collapse_alarms", "Acceptance-collapse alarms raised.", swaps.alarms),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        if self.flywheel is not None:
            yield from _flywheel_families(self.flywheel.metrics())


def _flywheel_families(m: dict):
    buffer = m["buffer"]
    yield GaugeMetricFamily("tandem:trace_buffer_bytes", "Bytes of traces held in the buffer.", value=buffer["bytes"])
    yield GaugeMetricFamily("tandem:trace_buffer_traces", "Traces held in the buffer.", value=buffer["traces"])
    yield CounterMetricFamily("tandem:trace_buffer_added", "Traces added to the buffer.", value=buffer["added"])
    yield CounterMetricFamily("tandem:trace_buffer_dropped", "Traces evicted or refused by the full buffer.", value=buffer["dropped"])
    yield CounterMetricFamily("tandem:trace_collector_dropped_records", "Step records the collector dropped.", value=m["collector_dropped_records"])
    trainer = m["trainer"]
    if trainer is not None:
        yield CounterMetricFamily("tandem:trainer_steps", "Online trainer optimiser steps.", value=trainer["steps"])
        yield GaugeMetricFamily("tandem:trainer_alive", "1 while the trainer thread runs.", value=int(bool(trainer["alive"])))
        yield GaugeMetricFamily("tandem:trainer_failed", "1 when the trainer stopped on an error.", value=int(trainer["error"] is not None))
        last = trainer["last"] or {}
        if "loss" in last:
            yield GaugeMetricFamily("tandem:trainer_loss", "Loss of the last trainer step.", value=last["loss"])


class ServerMetrics:
    def __init__(self, engine, loop, swapper=None, flywheel=None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.e2e_latency = Histogram("tandem:e2e_request_latency_seconds", "Request latency (HTTP handler start to last token).", buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("tandem:time_to_first_token_seconds", "Time to first token (HTTP handler start).", buckets=TTFT_BUCKETS, registry=r)
        self.request_success = Counter("tandem:request_success", "Finished requests by finish reason.", ["finished_reason"], registry=r)
        self.request_errors = Counter("tandem:request_errors", "Requests refused or failed, by kind.", ["kind"], registry=r)
        self.prompt_tokens = Counter("tandem:prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter("tandem:generation_tokens", "Tokens generated.", registry=r)
        running = Gauge("tandem:num_requests_running", "Requests in the engine's running batch.", registry=r)
        running.set_function(lambda: len(engine.running))
        waiting = Gauge("tandem:num_requests_waiting", "Requests accepted but not yet running.", registry=r)
        waiting.set_function(lambda: max(0, loop.held - len(engine.running)))
        failed = Gauge("tandem:engine_steps_failed", "Engine steps that raised (their requests were failed).", registry=r)
        failed.set_function(lambda: loop.steps_failed)
        r.register(SpecDecodeCollector(engine))
        if swapper is not None:
            r.register(FlywheelCollector(swapper, flywheel))

    def on_finish(self, usage: dict) -> None:
        """Engine-thread callback for each finished request."""
        self.prompt_tokens.inc(usage["prompt_tokens"])
        self.generation_tokens.inc(usage["output_tokens"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
