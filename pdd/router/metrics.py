"""Prometheus metrics of the router (its own, plus what workers report).

Latencies the router sees itself (TTFT, ITL, TPOT, E2E) are observed as they
happen. Worker samples (step latency, chunk sizes) arrive in heartbeats and are
observed on receipt; workers' monotonic totals (prefix-cache hits and queries)
become router counters by the delta between heartbeats. Worker state (free
pages, running requests) is read from the registry at scrape time by a
collector, so it is never stale after a worker leaves.

Every family is `pdd_`-prefixed; the seeds' SRE names are kept as the suffix
(`pdd_scheduler_iteration_latency_seconds`, ...). No `_created` series: they
double every counter and histogram and no dashboard reads them.
Per-worker series are dropped by `forget_worker` once a worker has left for good.
Counters of events that may never happen (a breaker forced, a connection
refused) have their series from the start, at 0, so a rate over them is
right from the first event.
"""
from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from pdd import __version__, build_info, security, tracing
from pdd.router import heap
from pdd.router.breaker import CAUSES, PATH, STATE_VALUE

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                    0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

# `pool`: how the placement that streamed the token runs — disagg (prompt on the
# prefill pool, KV shipped to the decode pool) or colocated (one worker did both,
# a local prefill included); `worker`: the decode worker that streamed it.
_TOKEN_LABELS = ["pool", "worker"]


class RouterMetrics:
    def __init__(self, registry_view=None):
        prometheus_client.disable_created_metrics()
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(namespace="pdd", registry=r)
        Info("pdd_build", "The router's build: pdd and Python versions", registry=r).info(
            {k: v for k, v in build_info().items() if k in ("version", "python")})
        self.ttft = Histogram("pdd_time_to_first_token_seconds", "Arrival to first token, at the router",
                              _TOKEN_LABELS, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = LoopHistogram("pdd_inter_token_latency_seconds",
                                 "Gap between consecutive token deliveries of a request (TBT)",
                                 _TOKEN_LABELS, buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("pdd_time_per_output_token_seconds", "(E2E - TTFT) / (tokens - 1) per request",
                              _TOKEN_LABELS, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pdd_e2e_request_latency_seconds", "Arrival to last token",
                             ["mode"], buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = Counter("pdd_requests", "Finished requests", ["mode", "finish_reason"], registry=r)
        self.prompt_tokens = Counter("pdd_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        # Counted once per stream per step: a plain int, read at scrape time (a
        # Counter's inc takes a lock).
        self.streamed_tokens = 0
        r.register(_ReadCounter("pdd_generation_tokens", "Tokens streamed to clients",
                                lambda: self.streamed_tokens))
        r.register(_CollectorTime())
        self.cached_tokens = Counter("pdd_prompt_cached_tokens", "Prompt tokens served from prefix caches",
                                     registry=r)
        self.migrations = Counter("pdd_request_migrations", "Requests re-admitted after a worker loss",
                                  registry=r)
        self.http_errors = Counter("pdd_http_errors", "Error responses", ["status"], registry=r)
        self.liveness = Counter("pdd_worker_liveness_events", "Workers turned suspect (silent past the "
                                "heartbeat window), back (heard within the grace, nothing moved) and lost "
                                "(for any reason: their requests moved)", ["event"], registry=r)
        self.inflight = Gauge("pdd_requests_in_flight", "Requests admitted and not finished", registry=r)
        self.step_latency = Histogram("pdd_scheduler_iteration_latency_seconds", "Engine step latency",
                                      ["worker"], buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill_chunk = Histogram("pdd_prefill_chunk_size_tokens", "Prefill chunk sizes scheduled",
                                       ["worker"], buckets=_TOKEN_BUCKETS, registry=r)
        self.decode_batch = Histogram("pdd_decode_batch_size_requests", "Decodes per engine step",
                                      ["worker"], buckets=_BATCH_BUCKETS, registry=r)
        self.prefix_hits = Counter("pdd_prefix_cache_hit_tokens", "Prompt tokens found in the worker's prefix "
                                   "cache (rate over pdd_prefix_cache_query_tokens_total: the hit ratio)",
                                   ["worker"], registry=r)
        self.prefix_queries = Counter("pdd_prefix_cache_query_tokens", "Prompt tokens looked up in the "
                                      "worker's prefix cache", ["worker"], registry=r)
        self.transfer_seconds = Histogram("pdd_prefill_to_decode_kv_transfer_seconds",
                                          "First page handed over to last page acknowledged, per pair",
                                          ["prefill", "decode"], buckets=_LATENCY_BUCKETS, registry=r)
        self.disagg_phase = Histogram("pdd_disagg_phase_seconds",
                                      "Router-side time of a disaggregated request's phases: reserve "
                                      "(Reserve sent -> Reserved), first_token (Prefill sent -> FirstToken), "
                                      "prefill (Prefill sent -> PrefillDone)",
                                      ["phase"], buckets=_LATENCY_BUCKETS, registry=r)
        self.transfer_bytes = Counter("pdd_kv_transfer_bytes", "KV bytes moved prefill -> decode, per pair "
                                      "(rate over pdd_prefill_to_decode_kv_transfer_seconds_sum: bandwidth)",
                                      ["prefill", "decode"], registry=r)
        self.blocks_sent = Counter("pdd_kv_transfer_blocks_sent", "KV blocks moved prefill -> decode", registry=r)
        self.blocks_skipped = Counter("pdd_kv_transfer_blocks_skipped",
                                      "KV blocks not sent: the decode worker had them cached", registry=r)
        self.transfer_failures = Counter("pdd_kv_transfer_failures", "KV transfers that failed", registry=r)
        self.fallbacks = Counter("pdd_disagg_fallbacks", "Disaggregated requests finished another way",
                                 ["reason"], registry=r)
        self.placements = Counter("pdd_placement", "Placement decisions: kind (disagg, local_prefill, colocated) "
                                  "and why (pdd.router.placement)", ["kind", "reason"], registry=r)
        self.rejected = Counter("pdd_requests_rejected", "Requests refused or cut by admission control",
                                ["reason"], registry=r)
        self.breaker_state = Gauge("pdd_breaker_state", "Circuit breaker per prefill->decode pair "
                                   "(0 closed, 1 open, 2 half-open; * * = the whole path)",
                                   ["prefill", "decode"], registry=r)
        self.breaker_transitions = Counter("pdd_breaker_transitions", "Circuit breaker state changes; cause: "
                                           "auto (the breaker's own failure counts) or admin (`pdd admin "
                                           "breaker`: forced, or given back to auto)",
                                           ["prefill", "decode", "to", "cause"], registry=r)
        self.show_breaker(*PATH, "closed")   # the whole path's, before anything is placed
        # A worker's (hit, query) totals as of its last heartbeat: the next delta's base.
        self._prefix_totals: dict[str, tuple[int, int]] = {}
        self._itl: dict[tuple[str, str], object] = {}   # (pool, worker) -> its pdd_inter_token_latency series
        if registry_view is not None:
            r.register(_WorkerCollector(registry_view))
        r.register(_TracingCollector())
        r.register(_SecurityCollector())

    def observe_heartbeat(self, hb) -> None:
        w = hb.worker_id
        for step in hb.steps:
            self.step_latency.labels(w).observe(step.latency_s)
            for n in step.prefill_chunks:
                self.prefill_chunk.labels(w).observe(n)
            if step.num_decodes:
                self.decode_batch.labels(w).observe(step.num_decodes)
        self._count_prefix_lookups(w, hb.prefix_hit_tokens, hb.prefix_query_tokens)

    def _count_prefix_lookups(self, worker_id: str, hits: int, queries: int) -> None:
        """Counters from a worker's totals. Totals below the last ones mean a new
        process under the same id: its totals are all new (a counter reset)."""
        last_hits, last_queries = self._prefix_totals.get(worker_id, (0, 0))
        if hits < last_hits or queries < last_queries:
            last_hits, last_queries = 0, 0
        self.prefix_hits.labels(worker_id).inc(hits - last_hits)
        self.prefix_queries.labels(worker_id).inc(queries - last_queries)
        self._prefix_totals[worker_id] = (hits, queries)

    def show_breaker(self, prefill: str, decode: str, state: str) -> None:
        """A breaker's state as placement reads it; its transition series exist from now on."""
        self.breaker_state.labels(prefill, decode).set(STATE_VALUE[state])
        for to in STATE_VALUE:
            for cause in CAUSES:
                self.breaker_transitions.labels(prefill, decode, to, cause)

    def breaker_moved(self, prefill: str, decode: str, new: str, cause: str) -> None:
        self.show_breaker(prefill, decode, new)
        self.breaker_transitions.labels(prefill, decode, new, cause).inc()

    def observe_tokens(self, state, now: float) -> None:
        """Tokens of `state` delivered at `now` (before state.deliver takes them)."""
        labels = (state.mode, state.decode_worker or "")
        if state.last_token_at is not None:
            itl = self._itl.get(labels)   # once per stream per step: the labelled series kept, not looked up
            if itl is None:
                itl = self._itl[labels] = self.itl.labels(*labels)
            itl.observe(now - state.last_token_at)
        else:
            self.ttft.labels(*labels).observe(now - state.arrival)

    def forget_worker(self, worker_id: str, pairs: list[tuple[str, str]]) -> None:
        """Drop the series of a worker that left for good, and of its breaker `pairs`."""
        for per_worker in (self.step_latency, self.prefill_chunk, self.decode_batch, self.prefix_hits,
                           self.prefix_queries):
            _remove(per_worker, worker_id)
        self._prefix_totals.pop(worker_id, None)
        self._itl = {labels: series for labels, series in self._itl.items() if labels[1] != worker_id}
        for per_token in (self.ttft, self.itl, self.tpot):
            for pool, worker in _label_sets(per_token, _TOKEN_LABELS):
                if worker == worker_id:
                    _remove(per_token, pool, worker)
        for per_pair in (self.transfer_seconds, self.transfer_bytes):
            for prefill, decode in _label_sets(per_pair, ["prefill", "decode"]):
                if worker_id in (prefill, decode):
                    _remove(per_pair, prefill, decode)
        for prefill, decode in pairs:
            _remove(self.breaker_state, prefill, decode)
            for state in STATE_VALUE:
                for cause in CAUSES:
                    _remove(self.breaker_transitions, prefill, decode, state, cause)

    def observe_transfer(self, prefill: str, decode: str, stats: dict) -> None:
        self.transfer_seconds.labels(prefill, decode).observe(float(stats.get("seconds", 0.0)))
        self.transfer_bytes.labels(prefill, decode).inc(int(stats.get("bytes", 0)))
        self.blocks_sent.inc(int(stats.get("blocks_sent", 0)))
        self.blocks_skipped.inc(int(stats.get("blocks_skipped", 0)))

    def observe_finished(self, state) -> None:
        """A request ended; call it while state.decode_worker still names its last worker."""
        self.requests.labels(state.mode, state.finish_reason or "unknown").inc()
        n = len(state.output_token_ids)
        if state.first_token_at is not None and state.last_token_at is not None:
            self.e2e.labels(state.mode).observe(state.last_token_at - state.arrival)
            if n > 1:
                self.tpot.labels(state.mode, state.decode_worker or "").observe(
                    (state.last_token_at - state.first_token_at) / (n - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class LoopHistogram:
    """A labelled histogram observed on the router's loop only, exposed as
    prometheus_client's Histogram would be. Each series is a list of counts and
    a sum, without a lock: prometheus_client's observe takes two locks and
    walks the buckets in Python (about 1.3 us), and the inter-token latency is
    observed once per stream per step."""

    def __init__(self, name: str, documentation: str, labelnames: list[str], buckets, registry):
        self.name, self.documentation, self.labelnames = name, documentation, list(labelnames)
        self.bounds = sorted(float(b) for b in buckets if b != float("inf"))
        self._le = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        self._series: dict[tuple[str, ...], _LoopSeries] = {}
        registry.register(self)

    def labels(self, *values: str) -> _LoopSeries:
        values = tuple(str(v) for v in values)
        series = self._series.get(values)
        if series is None:
            series = self._series[values] = _LoopSeries(self.bounds)
        return series

    def remove(self, *values: str) -> None:
        del self._series[tuple(str(v) for v in values)]

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, series in self._series.items():
            family.add_metric(list(values), list(zip(self._le, itertools.accumulate(series.counts))), series.sum)
        return [family]


class _ReadCounter:
    """A counter whose total is read from its owner when scraped."""

    def __init__(self, name: str, documentation: str, read: Callable[[], float]):
        self.name, self.documentation, self.read = name, documentation, read

    def collect(self):
        return [CounterMetricFamily(self.name, self.documentation, value=self.read())]


class _CollectorTime:
    """The garbage collector's time in this process since the router started (pdd.router.heap)."""

    def collect(self):
        seconds = CounterMetricFamily("pdd_router_gc_seconds", "Time in garbage collection, by generation",
                                      labels=["generation"])
        for generation, value in enumerate(heap.CLOCK.seconds):
            seconds.add_metric([str(generation)], value)
        return [seconds]


class _LoopSeries:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: list[float]):
        self.bounds, self.counts, self.sum = bounds, [0] * (len(bounds) + 1), 0.0

    def observe(self, amount: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, amount)] += 1   # the first bucket with le >= amount
        self.sum += amount


def _remove(metric, *labels: str) -> None:
    """One series gone (older prometheus_client versions raise KeyError for one never set)."""
    try:
        metric.remove(*labels)
    except KeyError:
        pass


def _label_sets(metric, names: list[str]) -> set[tuple[str, ...]]:
    """The label values of `metric`'s series, as tuples in the order of `names`."""
    return {tuple(s.labels[n] for n in names) for family in metric.collect() for s in family.samples
            if all(n in s.labels for n in names)}


class _WorkerCollector:
    """Worker state read from the registry at scrape time."""

    def __init__(self, registry):
        self.registry = registry

    def collect(self):
        free = GaugeMetricFamily("pdd_kv_cache_page_free_pages", "Free KV pages per worker", labels=["worker"])
        total = GaugeMetricFamily("pdd_kv_cache_page_total_pages", "KV pages per worker", labels=["worker"])
        hit = GaugeMetricFamily("pdd_prefix_cache_hit_ratio", "Prompt tokens found in the prefix cache / "
                                "queried, since the worker started (windowed: rate of "
                                "pdd_prefix_cache_hit_tokens_total over pdd_prefix_cache_query_tokens_total)",
                                labels=["worker"])
        running = GaugeMetricFamily("pdd_worker_running_requests", "Running requests", labels=["worker"])
        waiting = GaugeMetricFamily("pdd_worker_waiting_requests", "Queued requests", labels=["worker"])
        preemptions = CounterMetricFamily("pdd_scheduler_preemptions", "Requests preempted since the worker "
                                        "started: blocks freed, every computed token (prompt chunks "
                                        "included) recomputed later", labels=["worker"])
        compiled = CounterMetricFamily("pdd_kernels_compiled_in_service", "Triton kernels compiled after the "
                                       "worker's warm-up, each a stall of every request on it (should stay 0)",
                                       labels=["worker"])
        host = _HostTierFamilies()
        workers = GaugeMetricFamily("pdd_workers", "Registered workers", labels=["role", "accepting"])
        counts: dict[tuple[str, str], int] = {}
        for w in list(self.registry.workers.values()):
            counts[(w.role, str(w.accepting).lower())] = counts.get((w.role, str(w.accepting).lower()), 0) + 1
            if w.load is None:
                continue
            free.add_metric([w.worker_id], w.load.free_blocks)
            total.add_metric([w.worker_id], w.load.total_blocks)
            hit.add_metric([w.worker_id], w.load.prefix_hit_rate)
            running.add_metric([w.worker_id], w.load.running)
            waiting.add_metric([w.worker_id], w.load.waiting)
            preemptions.add_metric([w.worker_id], w.load.num_preemptions)
            compiled.add_metric([w.worker_id], w.load.kernels_compiled_in_service)
            host.add(w.worker_id, w.load.host_kv)
        for (role, accepting), n in counts.items():
            workers.add_metric([role, accepting], n)
        yield from (free, total, hit, running, waiting, preemptions, compiled, workers, *host.families)


class _HostTierFamilies:
    """The host KV tiers' accounting (pdd.kv.tier.TierStats), per worker that has one."""

    # (metric, its TierStats key, a counter, help)
    SERIES = (("pdd_host_kv_cache_blocks", "capacity_blocks", False, "KV blocks the host tier holds at most"),
              ("pdd_host_kv_cache_used_blocks", "used_blocks", False, "KV blocks in the host tier (occupancy)"),
              ("pdd_host_kv_cache_hit_blocks", "hit_blocks", True,
               "KV blocks loaded back to the GPU from the host tier instead of computed"),
              ("pdd_host_kv_cache_bytes_in", "bytes_in", True, "Bytes copied from the GPU pool into the host tier"),
              ("pdd_host_kv_cache_bytes_out", "bytes_out", True, "Bytes loaded from the host tier into the GPU pool"),
              ("pdd_host_kv_cache_evicted_blocks", "evicted_blocks", True,
               "KV blocks the host tier dropped (least recently used) for others"),
              ("pdd_host_kv_cache_loads", "loads", True, "Loads from the host tier into the GPU pool, finished"),
              ("pdd_host_kv_cache_load_wait_seconds", "load_wait_s", True,
               "Seconds from each load's start until the engine saw it done (what its request waited for the tier)"))

    def __init__(self):
        self.families = [(CounterMetricFamily if counter else GaugeMetricFamily)(name, doc, labels=["worker"])
                         for name, _, counter, doc in self.SERIES]

    def add(self, worker_id: str, stats: dict) -> None:
        if stats:
            for family, (_, key, _, _) in zip(self.families, self.SERIES):
                family.add_metric([worker_id], stats.get(key, 0))


class _TracingCollector:
    """The router's span exporter (pdd.tracing), when tracing is on."""

    def collect(self):
        stats = tracing.stats()
        if stats is None:
            return
        exported = CounterMetricFamily("pdd_trace_spans_exported", "Spans the OTLP collector accepted")
        exported.add_metric([], stats["exported"])
        dropped = CounterMetricFamily("pdd_trace_spans_dropped", "Spans not exported: queue_full (the export "
                                      "queue was full) or export_failed (the collector refused them, was "
                                      "unreachable or too slow)", labels=["reason"])
        dropped.add_metric(["queue_full"], stats["dropped_queue_full"])
        dropped.add_metric(["export_failed"], stats["dropped_export_failed"])
        yield from (exported, dropped)


class _SecurityCollector:
    """What the HTTP guard (pdd.http.guard) and the control plane refused or cut,
    from the process's security counts (those of `pdd admin security`)."""

    CUT_REASONS = ("send_timeout", "buffer_limit")   # counted as http.<reason>

    def collect(self):
        counts = security.counts()
        refused = CounterMetricFamily("pdd_http_connections_refused", "Connections answered 503 and closed: "
                                      "security.http_max_connections were open")
        refused.add_metric([], counts.get("http.connection_limit", 0))
        cut = CounterMetricFamily("pdd_http_clients_cut", "Clients that did not take what they were sent: "
                                  "send_timeout (the connection took no byte for router.http_send_timeout_s: "
                                  "cut) or buffer_limit (its stream held router.max_buffered_tokens: ended "
                                  "with an error)", labels=["reason"])
        for reason in self.CUT_REASONS:
            cut.add_metric([reason], counts.get(f"http.{reason}", 0))
        yield from (refused, cut)
