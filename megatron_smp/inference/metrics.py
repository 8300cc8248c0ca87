"""The server's `/metrics`: Prometheus text format through `prometheus_client` (the `serve`
extra), with vLLM's metric names under the `megatron_smp:` prefix.

    megatron_smp:num_requests_running / num_requests_waiting   gauges (read at each scrape)
    megatron_smp:kv_cache_blocks_used / kv_cache_blocks_total  gauges, the leader's cache
                                                               (its replica's with replicas),
                                                               full-attention blocks
    megatron_smp:kv_cache_usage_perc                           used / total
    megatron_smp:prompt_tokens_total                           counter, prompts submitted
    megatron_smp:generation_tokens_total                       counter, tokens generated
    megatron_smp:request_success_total{finished_reason}        counter, stop / length / abort
    megatron_smp:time_to_first_token_seconds                   histogram, submit -> first token
    megatron_smp:time_per_output_token_seconds                 histogram, each later token: the
                                                               time since the request's previous
                                                               step over the tokens it brought
    megatron_smp:spec_decode_num_draft_tokens_total            counter, drafts verified
    megatron_smp:spec_decode_num_accepted_tokens_total         counter, drafts accepted
    megatron_smp:spec_decode_acceptance_rate                   accepted / drafted (0 before any)

The histograms and token counters are fed by the engine thread (`on_submit`, `on_advance`);
the gauges and speculative counts are read from the engine when scraped.
"""
from __future__ import annotations

import threading
import time
from typing import Dict, List, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "megatron_smp:"
# Seconds: from a fast decode step on a small model to a long prompt queued behind others.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5, 5.0)


def _blocks(engine) -> Optional[tuple]:
    """(used, total) full-attention blocks of the engine's (or its replica's) cache."""
    engine = getattr(engine, "engine", engine)  # data-parallel replicas: this rank's
    allocator = getattr(engine, "allocators", {}).get(None)
    if allocator is None:
        return None
    return allocator.num_blocks - allocator.num_free, allocator.num_blocks


class _EngineCollector:
    """Gauges and the speculative counts, read from the engine at scrape time."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def collect(self):
        engine = self.engine
        yield GaugeMetricFamily(PREFIX + "num_requests_running", "Requests in the batch",
                                value=len(engine.running))
        yield GaugeMetricFamily(PREFIX + "num_requests_waiting", "Requests queued",
                                value=len(engine.waiting))
        blocks = _blocks(engine)
        if blocks is not None:
            used, total = blocks
            yield GaugeMetricFamily(PREFIX + "kv_cache_blocks_used",
                                    "KV cache blocks held by requests", value=used)
            yield GaugeMetricFamily(PREFIX + "kv_cache_blocks_total", "KV cache blocks",
                                    value=total)
            yield GaugeMetricFamily(PREFIX + "kv_cache_usage_perc",
                                    "Fraction of the KV cache blocks in use",
                                    value=used / total if total else 0.0)
        if getattr(engine, "speculative", None) is not None:
            drafted, accepted = engine.num_drafted, engine.num_accepted
            yield CounterMetricFamily(PREFIX + "spec_decode_num_draft_tokens",
                                      "Draft tokens verified", value=drafted)
            yield CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens",
                                      "Draft tokens accepted", value=accepted)
            yield GaugeMetricFamily(PREFIX + "spec_decode_acceptance_rate",
                                    "Accepted over drafted tokens",
                                    value=accepted / drafted if drafted else 0.0)


class ServerMetrics:
    """One server's registry (its own, so that several servers in one process do not mix)."""

    def __init__(self, engine) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens submitted",
                                     registry=self.registry)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated",
                                         registry=self.registry)
        self.finished = Counter(PREFIX + "request_success", "Requests finished",
                                ["finished_reason"], registry=self.registry)
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds", "Seconds from submission to the first "
            "token", buckets=TTFT_BUCKETS, registry=self.registry)
        self.time_per_output_token = Histogram(
            PREFIX + "time_per_output_token_seconds", "Seconds per output token after the "
            "first", buckets=TPOT_BUCKETS, registry=self.registry)
        self._lock = threading.Lock()
        # request id -> [submitted at, last tokens at (None before the first), tokens seen]
        self._requests: Dict[int, List] = {}

    def on_submit(self, request) -> None:
        self.prompt_tokens.inc(len(request.prompt))
        with self._lock:
            self._requests[request.request_id] = [time.perf_counter(), None, 0]

    def on_advance(self, request) -> None:
        now = time.perf_counter()
        with self._lock:
            record = self._requests.get(request.request_id)
        if record is None:
            return
        new = len(request.output) - record[2]
        if new > 0:
            self.generation_tokens.inc(new)
            if record[1] is None:
                self.time_to_first_token.observe(now - record[0])
                new -= 1  # the rest of the step's tokens (speculative decoding) came with it
                elapsed = 0.0
            else:
                elapsed = now - record[1]
            for _ in range(new):
                self.time_per_output_token.observe(elapsed / new)
            record[1], record[2] = now, len(request.output)
        if request.finished:
            self.forget(request.request_id, request.finish_reason)

    def forget(self, request_id: int, reason: Optional[str] = "abort") -> None:
        with self._lock:
            known = self._requests.pop(request_id, None)
        if known is not None and reason is not None:
            self.finished.labels(finished_reason=reason).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


__all__ = ["ServerMetrics", "PREFIX"]
