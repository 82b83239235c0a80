"""``GET /metrics``: the server's counters in Prometheus' text format (prometheus-client).

The names are vLLM's (``vllm:num_requests_running`` ...) with the prefix ``portable_llm:``
instead of ``vllm:``, so a dashboard written for vLLM needs only the prefix changed; the KV page
gauges have no vLLM counterpart (vLLM counts blocks as a fraction, ``kv_cache_usage_perc``,
which is here too). Every series carries the label ``model_name``, as vLLM's do.

:class:`ServeMetrics` holds its own ``CollectorRegistry`` (never the process-wide one), so two
apps in one process keep apart. The engine thread reports admissions, tokens and ends through
the :class:`~portable_llm.serve.engine.EngineObserver` methods; the gauges are read from
:meth:`~portable_llm.serve.engine.Engine.health` when the page is scraped.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from portable_llm.serve.engine import Engine, Job

__all__ = ["CONTENT_TYPE", "PREFIX", "ServeMetrics"]

#: The prefix of every metric name (vLLM's is ``vllm:``).
PREFIX = "portable_llm:"
#: The ``Content-Type`` of the page.
CONTENT_TYPE = CONTENT_TYPE_LATEST

# Bucket bounds (seconds): from a fast accelerator to a large model on a laptop's CPU.
_TTFT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
         160.0, 640.0)  # fmt: skip
_PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
              1.0, 2.5, 5.0, 10.0)  # fmt: skip
_REQUEST = (0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0,
            960.0, 1920.0, 7680.0)  # fmt: skip


class ServeMetrics:
    """The metrics of one app over one engine, in a registry of their own.

    Parameters
    ----------
    engine : Engine
        Its gauges are read at each scrape; attach this object as its ``observer`` for the
        counters and histograms (:func:`~portable_llm.serve.app.create_app` does).
    model_name : str
        The value of the ``model_name`` label.

    Attributes
    ----------
    registry : prometheus_client.CollectorRegistry
    """

    def __init__(self, engine: Engine, *, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._queried = 0  # prompt tokens looked up in the prefix cache (the engine thread)
        self._hit = 0  # of which found there
        # id() of each job admitted and not ended -> [sum of its gaps between tokens, gaps]
        self._running: dict[int, list[float]] = {}

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, ["model_name"], registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(
                PREFIX + name, doc, ["model_name"], buckets=buckets, registry=self.registry
            )

        m = model_name
        self.prompt_tokens = counter(
            "prompt_tokens", "Prompt tokens of admitted requests (prefix-cache hits included)."
        ).labels(m)
        self.generation_tokens = counter(
            "generation_tokens", "Tokens generated (a final EOS included)."
        ).labels(m)
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        ).labels(m)
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache (not prefilled)."
        ).labels(m)
        self.request_success = Counter(
            PREFIX + "request_success",
            "Requests ended, by finished_reason: stop, length, abort (cancelled), error.",
            ["model_name", "finished_reason"], registry=self.registry,
        )  # fmt: skip
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds",
            "From the request's arrival at the engine to its first token.", _TTFT,
        ).labels(m)  # fmt: skip
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Between two consecutive tokens of a request.",
            _PER_TOKEN,
        ).labels(m)  # fmt: skip
        self.time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "Per request of two tokens or more: the mean gap between two tokens of a choice.",
            _PER_TOKEN,
        ).labels(m)  # fmt: skip
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "From the request's arrival at the engine to its end.",
            _REQUEST,
        ).labels(m)  # fmt: skip
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "From arrival at the engine to admission to the batch.",
            _REQUEST,
        ).labels(m)  # fmt: skip
        self.registry.register(_EngineGauges(engine, self))

    # -- EngineObserver: called by the engine thread ----------------------------------------------
    def admitted(self, job: Job, now: float) -> None:
        """``job`` joined the batch at ``now`` with ``job.cached`` prompt tokens from the cache."""
        self._running[id(job)] = [0.0, 0]
        n = len(job.prompt)
        self.prompt_tokens.inc(n)
        self.prefix_cache_queries.inc(n)
        self.prefix_cache_hits.inc(job.cached)
        self._queried += n
        self._hit += job.cached
        self.request_queue_time.observe(max(0.0, now - job.submitted))

    def token(self, job: Job, now: float, gap: float | None) -> None:
        """``job`` drew a token at ``now``, ``gap`` seconds after its choice's token before
        (``None``: the choice's first; the job's first when ``job.generated`` is 1)."""
        self.generation_tokens.inc()
        if job.generated == 1:
            self.time_to_first_token.observe(max(0.0, now - job.submitted))
        if gap is not None:
            self.inter_token_latency.observe(gap)
            gaps = self._running.get(id(job))
            if gaps is not None:
                gaps[0] += gap
                gaps[1] += 1

    def ended(self, job: Job, now: float, reason: str) -> None:
        """``job`` left the engine at ``now`` (``reason``: stop, length, abort or error).
        Its time per output token: the mean gap between two tokens of one choice (for one
        choice, (last - first) / (tokens - 1)); none without a second token."""
        total, gaps = self._running.pop(id(job), (0.0, 0))
        self.request_success.labels(self.model_name, reason).inc()
        self.e2e_request_latency.observe(max(0.0, now - job.submitted))
        if gaps:
            self.time_per_output_token.observe(total / gaps)

    # -- the page -------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        """Requests admitted to the batch and not ended (the engine's ``running`` also counts
        those handed to the generator that wait for room in it)."""
        return len(self._running)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens found in the prefix cache over those looked up, so far (0 before any)."""
        return self._hit / self._queried if self._queried else 0.0

    def render(self) -> bytes:
        """The page, in Prometheus' text format (:data:`CONTENT_TYPE`)."""
        return generate_latest(self.registry)


class _EngineGauges(Collector):
    """The gauges, read from the engine's :meth:`~portable_llm.serve.engine.Engine.health` at
    each scrape (as of its last step)."""

    def __init__(self, engine: Engine, metrics: ServeMetrics) -> None:
        self.engine, self.metrics = engine, metrics

    def collect(self) -> Iterator[Metric]:
        h = self.engine.health()
        total, free, cached = h["pool_pages"], h["free_pages"], h["cached_pages"]
        used = max(0, total - free - cached)  # held by requests (cached ones they share too)
        rows = [
            ("num_requests_running", "Requests in the batch (decoding or in prefill).",
             self.metrics.num_running),
            ("num_requests_waiting", "Requests waiting to join the batch.", h["queue_depth"]),
            ("kv_pages_used", "KV pages (per layer) held by requests.", used),
            ("kv_pages_cached", "KV pages (per layer) only the prefix cache holds: freed when "
             "the pool runs short.", cached),
            ("kv_pages_free", "KV pages (per layer) free.", free),
            ("kv_pages_total", "KV pages (per layer) in the pool.", total),
            ("kv_cache_usage_perc", "kv_pages_used / kv_pages_total (0 to 1).",
             used / total if total else 0.0),
            ("prefix_cache_hit_rate", "prefix_cache_hits / prefix_cache_queries so far (0 to 1).",
             self.metrics.prefix_cache_hit_rate),
        ]  # fmt: skip
        for name, doc, value in rows:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self.metrics.model_name], value)
            yield family
