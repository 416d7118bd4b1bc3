"""Counters and histograms of the server, rendered in Prometheus' text exposition format (version 0.0.4)."""

import threading
from collections import Counter
from collections.abc import Callable

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def label(value: str) -> str:
    """A label value as the exposition format writes it: a served name may hold a quote, backslash or newline."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Histogram:
    def __init__(self, buckets: tuple):
        self.buckets = buckets
        self.counts = [0] * len(buckets)  # per bucket, not cumulative; render() sums them
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
                break
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, total = [], 0
        for bound, count in zip(self.buckets, self.counts, strict=True):
            total += count
            out.append(f'{name}_bucket{{{labels},le="{bound}"}} {total}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.count}')
        return out + [f"{name}_sum{{{labels}}} {self.sum}", f"{name}_count{{{labels}}} {self.count}"]


class Metrics:
    """Requests and errors by route and status, latency by route; per model: batches (inputs per batch), inputs
    and tokens processed, queue depth (read from `queue_depth` callbacks when rendered). Thread-safe."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: Counter = Counter()  # (route, status) -> count
        self.in_flight = 0
        self.latency: dict[str, Histogram] = {}
        self.batches: dict[str, Histogram] = {}
        self.inputs: Counter = Counter()
        self.tokens: Counter = Counter()
        self.queue_depth: dict[str, Callable[[], int]] = {}

    def started(self) -> None:
        with self.lock:
            self.in_flight += 1

    def request(self, route: str, status: int, seconds: float) -> None:
        """A request answered (`started` counted it in flight)."""
        with self.lock:
            self.in_flight -= 1
            self.requests[route, status] += 1
            self.latency.setdefault(route, Histogram(LATENCY_BUCKETS)).observe(seconds)

    def batch(self, model: str, inputs: int, tokens: int) -> None:
        with self.lock:
            self.batches.setdefault(model, Histogram(BATCH_BUCKETS)).observe(inputs)
            self.inputs[model] += inputs
            self.tokens[model] += tokens

    def render(self) -> str:
        p = "mlx_encoders"
        with self.lock:
            lines = [f"# HELP {p}_requests_total HTTP requests answered, by route and status.",
                     f"# TYPE {p}_requests_total counter"]  # fmt: skip
            counts = sorted(self.requests.items())
            lines += [f'{p}_requests_total{{route="{label(r)}",status="{s}"}} {n}' for (r, s), n in counts]
            lines += [f"# HELP {p}_request_errors_total HTTP requests answered with status 400 or more.",
                      f"# TYPE {p}_request_errors_total counter"]  # fmt: skip
            errors = sorted((k, n) for k, n in self.requests.items() if k[1] >= 400)
            lines += [f'{p}_request_errors_total{{route="{label(r)}",status="{s}"}} {n}' for (r, s), n in errors]
            lines += [f"# HELP {p}_request_duration_seconds Time from request to response, by route.",
                      f"# TYPE {p}_request_duration_seconds histogram"]  # fmt: skip
            for route, histogram in sorted(self.latency.items()):
                lines += histogram.lines(f"{p}_request_duration_seconds", f'route="{label(route)}"')
            lines += [f"# HELP {p}_batch_size Inputs per batch a model worker ran.",
                      f"# TYPE {p}_batch_size histogram"]  # fmt: skip
            for model, histogram in sorted(self.batches.items()):
                lines += histogram.lines(f"{p}_batch_size", f'model="{label(model)}"')
            for name, counter, text in (("inputs", self.inputs, "Inputs"), ("tokens", self.tokens, "Tokens")):
                lines += [f"# HELP {p}_{name}_total {text} processed by a model.", f"# TYPE {p}_{name}_total counter"]
                lines += [f'{p}_{name}_total{{model="{label(m)}"}} {n}' for m, n in sorted(counter.items())]
            depths = sorted(self.queue_depth.items())
            lines += [f"# HELP {p}_requests_in_flight HTTP requests being answered, this one included.",
                      f"# TYPE {p}_requests_in_flight gauge", f"{p}_requests_in_flight {self.in_flight}"]  # fmt: skip
        lines += [f"# HELP {p}_queue_depth Requests waiting for a model.", f"# TYPE {p}_queue_depth gauge"]
        lines += [f'{p}_queue_depth{{model="{label(m)}"}} {depth()}' for m, depth in depths]
        return "\n".join(lines) + "\n"
