"""Prometheus metrics of the server, named like vLLM's (prefix `tandem:`), in a registry per server.

Spec-decode counters and flywheel numbers are read at scrape time from the components that own them
(EngineStats, Flywheel.metrics(), HotSwapper stats): nothing on the engine's hot path updates Prometheus.
Request latency and time to first token are measured by the HTTP handlers (they include HTTP overhead);
queue, prefill, decode and inter-token times by the engine loop (engine-thread callbacks: a histogram
observation each, no I/O).
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


class SpeculationCollector:
    """The speculation controller's decisions (tandem.engine.control): whether it drafts, its steps, probes and
    switches, the rows each draft shape was chosen for, and its predicted vs realised speedup over plain decoding."""

    def __init__(self, policy):
        self.policy = policy

    def collect(self):
        m = self.policy.metrics()  # read on the scrape thread: plain numbers and fresh dicts
        yield GaugeMetricFamily("tandem:spec_control_speculating", "1 while the controller drafts (0: plain, probing now and then).", value=int(m["speculating"]))
        for name, doc, value in (
            ("tandem:spec_control_steps", "Engine steps the controller planned.", m["steps"]),
            ("tandem:spec_control_speculative_steps", "Steps in which some row drafted.", m["speculative_steps"]),
            ("tandem:spec_control_probes", "Drafting steps taken while off, to re-measure.", m["probes"]),
            ("tandem:spec_control_switches", "Switches between drafting and plain decoding.", m["switches"]),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        rows = CounterMetricFamily("tandem:spec_control_shape_rows", "Request-steps per draft shape chosen (plain = no draft).", labels=["shape"])
        for shape, count in m["shape_rows"].items():
            rows.add_metric([shape], count)
        yield rows
        for name, doc, value in (
            ("tandem:spec_control_predicted_speedup", "Mean predicted speedup over plain of the drafting steps.", m["predicted_speedup_mean"]),
            ("tandem:spec_control_realised_speedup", "Mean realised speedup over plain of the drafting steps.", m["realised_speedup_mean"]),
            ("tandem:spec_control_realised_speedup_overall", "Plain-equivalent time over actual time, every step.", m["realised_speedup_overall"]),
        ):
            yield GaugeMetricFamily(name, doc, value=float(value))


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
    yield CounterMetricFamily("tandem:trace_aborted_requests", "Partial traces of aborted requests (stop strings, disconnects) finished as traces.",
                              value=m.get("collector_aborted_traces", 0))
    yield CounterMetricFamily("tandem:trace_spill_pruned_shards", "Spilled trace shards deleted by retention.", value=buffer.get("spill_pruned", 0))
    trainer = m["trainer"]
    if trainer is not None:
        yield CounterMetricFamily("tandem:trainer_steps", "Online trainer optimiser steps.", value=trainer["steps"])
        yield GaugeMetricFamily("tandem:trainer_alive", "1 while the trainer thread runs.", value=int(bool(trainer["alive"])))
        yield GaugeMetricFamily("tandem:trainer_failed", "1 when the trainer stopped on an error.", value=int(trainer["error"] is not None))
        last = trainer["last"] or {}
        if "loss" in last:
            yield GaugeMetricFamily("tandem:trainer_loss", "Loss of the last trainer step.", value=last["loss"])


TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class _Labelled:
    """Sets the `model_name` label on every family a collector yields (vLLM labels each metric with it)."""

    def __init__(self, collector, model_name: str):
        self.collector, self.model_name = collector, model_name

    def collect(self):
        for family in self.collector.collect():
            for sample in family.samples:
                sample.labels["model_name"] = self.model_name
            yield family


class ServerMetrics:
    """vLLM's request metrics, same meaning, prefix `tandem:`, label `model_name`:

    - time_to_first_token_seconds: handler start -> first output (includes queueing and prefill, as vLLM's);
    - inter_token_latency_seconds (and its older name time_per_output_token_seconds): time between two
      consecutive outputs of one request (a speculative step may deliver several tokens at once);
    - request_time_per_output_token_seconds: a request's decode time / (output tokens - 1);
    - e2e_request_latency_seconds, request_queue_time_seconds (submitted -> prefill start),
      request_prefill_time_seconds, request_decode_time_seconds (first -> last token), request_inference_time_seconds;
    - request_prompt_tokens / request_generation_tokens histograms, prompt_tokens / generation_tokens counters;
    - num_requests_running / num_requests_waiting / kv_cache_usage_perc gauges;
    - request_success{finished_reason} and request_failure{kind} counters.
    """

    def __init__(self, engine, loop, swapper=None, flywheel=None, model_name: str = "model"):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, label = self.registry, ["model_name"]

        def histogram(name, doc, buckets):
            return Histogram(f"tandem:{name}", doc, label, buckets=buckets, registry=r).labels(model_name)

        self.e2e_latency = histogram("e2e_request_latency_seconds", "Request latency: HTTP handler start to last token.", LATENCY_BUCKETS)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token: HTTP handler start to the first output.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between two consecutive outputs of a request.", ITL_BUCKETS)
        self.tpot_iter = histogram("time_per_output_token_seconds", "Time between two consecutive outputs of a request (vLLM's older name).", ITL_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds", "A request's decode time / (output tokens - 1).", ITL_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Submitted to the engine loop -> prefill start.", LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "Prefill start -> first token.", LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "First token -> last token.", LATENCY_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "Prefill start -> last token.", LATENCY_BUCKETS)
        self.prompt_len = histogram("request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.generation_len = histogram("request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS)
        self._success = Counter("tandem:request_success", "Finished requests by finish reason.", ["model_name", "finished_reason"], registry=r)
        self._failure = Counter("tandem:request_failure", "Requests refused or failed, by kind.", ["model_name", "kind"], registry=r)
        self.prompt_tokens = Counter("tandem:prompt_tokens", "Prompt tokens processed.", label, registry=r).labels(model_name)
        self.generation_tokens = Counter("tandem:generation_tokens", "Tokens generated.", label, registry=r).labels(model_name)

        def gauge(name, doc, fn):
            Gauge(f"tandem:{name}", doc, label, registry=r).labels(model_name).set_function(fn)

        gauge("num_requests_running", "Requests in the engine's batch (decoding or prefilling).", lambda: len(engine.running) + (engine.prefilling is not None))
        gauge("num_requests_waiting", "Requests accepted but not yet running.", lambda: max(0, loop.held - len(engine.running) - (engine.prefilling is not None)))
        gauge("kv_cache_usage_perc", "Share of the KV cache holding tokens (1 = full).", lambda: kv_cache_usage(engine.cache))
        gauge("engine_loop_healthy", "1 while the engine loop takes requests.", lambda: int(loop.healthy))
        r.register(_Labelled(_LoopCounters(loop), model_name))
        r.register(_Labelled(SpecDecodeCollector(engine), model_name))
        if hasattr(engine.draft_policy, "metrics"):
            r.register(_Labelled(SpeculationCollector(engine.draft_policy), model_name))
        if swapper is not None:
            r.register(_Labelled(FlywheelCollector(swapper, flywheel), model_name))

    def success(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def failed(self, kind: str) -> None:
        self._failure.labels(self.model_name, kind).inc()

    def on_finish(self, usage: dict) -> None:
        """Engine-thread callback for each finished request (engine timings)."""
        self.prompt_tokens.inc(usage["prompt_tokens"])
        self.generation_tokens.inc(usage["output_tokens"])
        self.prompt_len.observe(usage["prompt_tokens"])
        self.generation_len.observe(usage["output_tokens"])
        if "queue_time_s" in usage:
            self.queue_time.observe(usage["queue_time_s"])
            self.prefill_time.observe(usage["prefill_time_s"])
            self.decode_time.observe(usage["decode_time_s"])
            self.inference_time.observe(usage["inference_time_s"])
            if usage["output_tokens"] > 1:
                self.tpot.observe(usage["decode_time_s"] / (usage["output_tokens"] - 1))

    def on_tokens(self, interval_s: float) -> None:
        """Engine-thread callback: the time since the request's previous output."""
        self.itl.observe(interval_s)
        self.tpot_iter.observe(interval_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _LoopCounters:
    def __init__(self, loop):
        self.loop = loop

    def collect(self):
        loop = self.loop
        yield CounterMetricFamily("tandem:engine_steps_failed", "Engine steps that raised (their requests were failed).", value=loop.steps_failed)
        yield CounterMetricFamily("tandem:engine_prefills_failed", "Prefills that raised (the engine failed their request alone).", value=loop.prefills_failed)
        yield CounterMetricFamily("tandem:engine_loop_iterations_failed", "Engine loop iterations that raised outside a step (every request in flight was failed).",
                                  value=loop.iterations_failed)
        yield CounterMetricFamily("tandem:request_queue_timeouts", "Requests failed for waiting longer than the queue timeout.", value=loop.queue_timeouts)


def kv_cache_usage(cache) -> float:
    """Tokens held in the KV cache over its capacity (rows x row length)."""
    return float(cache.lengths.sum()) / float(cache.max_batch * cache.max_len)
