"""The server's Prometheus metrics, through `prometheus_client` on a registry of the server's own (two servers in
one process count apart): requests by route and status and their latency, per model the time a request waits for
its first batch, the inputs and tokens of each batch and of each request, the queue depth, and the process's
metrics (CPU, memory, file descriptors; Python's garbage collector and version)."""

import os
import sys
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

PREFIX = "mlx_encoders"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
TOKEN_BUCKETS = (8, 32, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


class QueueDepth:
    """A collector reading each model's queue depth when scraped."""

    def __init__(self, depths: dict[str, Callable[[], int]]):
        self.depths = depths

    def collect(self):
        family = GaugeMetricFamily(f"{PREFIX}_queue_depth", "Requests waiting for a model.", labels=["model"])
        for model, depth in sorted(self.depths.items()):
            family.add_metric([model], depth())
        yield family


class PortableProcess:
    """The process metrics `ProcessCollector` reads from /proc, where there is none (macOS): CPU time and open file
    descriptors, from the standard library."""

    def collect(self):
        times = os.times()
        yield CounterMetricFamily("process_cpu_seconds_total", "Total user and system CPU time spent in seconds.",
                                  value=times.user + times.system)  # fmt: skip
        if os.path.isdir("/dev/fd"):
            yield GaugeMetricFamily("process_open_fds", "Number of open file descriptors.", len(os.listdir("/dev/fd")))


class Metrics:
    """Counters, gauges and histograms of one server; `render` gives Prometheus' text format. Thread-safe (model
    workers record batches)."""

    def __init__(self):
        self.registry = registry = CollectorRegistry()
        p = PREFIX
        self.requests = Counter(f"{p}_requests", "HTTP requests answered, by route and status.", ["route", "status"],
                                registry=registry)  # fmt: skip
        self.errors = Counter(f"{p}_request_errors", "HTTP requests answered with status 400 or more.",
                              ["route", "status"], registry=registry)  # fmt: skip
        self.latency = Histogram(f"{p}_request_duration_seconds", "Time from request to response, by route.",
                                 ["route"], buckets=LATENCY_BUCKETS, registry=registry)  # fmt: skip
        self.in_flight = Gauge(f"{p}_requests_in_flight", "HTTP requests being answered, this one included.",
                               registry=registry)  # fmt: skip
        self.waits = Histogram(f"{p}_queue_duration_seconds", "Time a request waits for its first batch, by model.",
                               ["model"], buckets=WAIT_BUCKETS, registry=registry)  # fmt: skip
        self.batches = Histogram(f"{p}_batch_size", "Inputs per batch a model worker ran.", ["model"],
                                 buckets=BATCH_BUCKETS, registry=registry)  # fmt: skip
        self.batch_tokens = Histogram(f"{p}_batch_tokens", "Tokens per batch a model worker ran.", ["model"],
                                      buckets=TOKEN_BUCKETS, registry=registry)  # fmt: skip
        self.request_tokens = Histogram(f"{p}_request_tokens", "Tokens per request a model ran.", ["model"],
                                        buckets=TOKEN_BUCKETS, registry=registry)  # fmt: skip
        self.inputs = Counter(f"{p}_inputs", "Inputs processed by a model.", ["model"], registry=registry)
        self.tokens = Counter(f"{p}_tokens", "Tokens processed by a model.", ["model"], registry=registry)
        self.queue_depth: dict[str, Callable[[], int]] = {}
        registry.register(QueueDepth(self.queue_depth))
        if os.path.exists("/proc/self/stat"):
            ProcessCollector(registry=registry)
        else:
            registry.register(PortableProcess())
        PlatformCollector(registry=registry)
        if sys.implementation.name == "cpython":
            GCCollector(registry=registry)

    def started(self) -> None:
        self.in_flight.inc()

    def request(self, route: str, status: int, seconds: float) -> None:
        """A request answered (`started` counted it in flight)."""
        self.in_flight.dec()
        self.requests.labels(route, str(status)).inc()
        if status >= 400:
            self.errors.labels(route, str(status)).inc()
        self.latency.labels(route).observe(seconds)

    def waited(self, model: str, seconds: float) -> None:
        self.waits.labels(model).observe(seconds)

    def ran(self, model: str, tokens: int) -> None:
        """A request's inputs computed: `tokens` in all."""
        self.request_tokens.labels(model).observe(tokens)

    def batch(self, model: str, inputs: int, tokens: int) -> None:
        self.batches.labels(model).observe(inputs)
        self.batch_tokens.labels(model).observe(tokens)
        self.inputs.labels(model).inc(inputs)
        self.tokens.labels(model).inc(tokens)

    def render(self) -> str:
        return generate_latest(self.registry).decode()
