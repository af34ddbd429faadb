"""``GET /metrics``: the server's counters in the Prometheus text exposition format (version
0.0.4, https://prometheus.io/docs/instrumenting/exposition_formats/), every name prefixed
``zerotron_``:

* ``zerotron_requests_total{endpoint, code}`` (counter): HTTP requests answered;
* ``zerotron_queue_depth`` (gauge): rows (prompt x choice) submitted that have no token yet;
* ``zerotron_running_rows`` (gauge): rows in the continuous batch now;
* ``zerotron_generated_tokens_total`` (counter): tokens generated for answered requests;
* ``zerotron_cancelled_rows_total`` (counter): rows dropped because their client disconnected;
* ``zerotron_kv_blocks_used`` / ``zerotron_kv_blocks_free`` (gauges): paged KV cache blocks
  referenced by rows / not referenced (free or holding evictable cached prefixes), all dp replicas;
* ``zerotron_kv_slots_allocated`` / ``zerotron_kv_slots_filled`` (gauges): token slots of the
  blocks in use / of those, slots holding a cached token (each shared block once): the KV waste
  is 1 - filled / allocated;
* ``zerotron_prefix_cache_hits_total`` / ``zerotron_prefix_cache_misses_total`` (counters): full
  prompt blocks found / not found in the prefix cache;
* ``zerotron_preemptions_total`` (counter): rows preempted when the pool ran out (recomputed later);
* ``zerotron_spec_proposed_tokens_total`` / ``zerotron_spec_accepted_tokens_total`` (counters) and
  ``zerotron_spec_acceptance_rate`` (gauge, accepted / proposed): speculative decoding;
* ``zerotron_time_to_first_token_seconds`` (histogram): submit -> the row's first token;
* ``zerotron_time_per_output_token_seconds`` (histogram): (last token - first token) / (tokens - 1)
  per row of at least 2 tokens.

The timings come from the batcher's per-token callbacks (``Job.token``); rows decoded on another
dp replica than rank 0's under window batching have none and are left out of the histograms."""
from __future__ import annotations

import threading

__all__ = ["Histogram", "Metrics", "TTFT_BUCKETS", "TPOT_BUCKETS"]

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


def _num(x: float) -> str:
    return repr(float(x)) if x != int(x) or abs(x) >= 1e15 else str(int(x))


class Histogram:
    """A cumulative Prometheus histogram of seconds over ``buckets`` (upper bounds, ascending)."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]):
        self.name, self.doc, self.buckets = name, doc, buckets
        self.counts, self.sum, self.count = [0] * len(buckets), 0.0, 0

    def observe(self, x: float) -> None:
        for i, b in enumerate(self.buckets):
            if x <= b:
                self.counts[i] += 1
        self.sum += x
        self.count += 1

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} histogram"]
        out += [f'{self.name}_bucket{{le="{b:g}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out += [f'{self.name}_bucket{{le="+Inf"}} {self.count}', f"{self.name}_sum {_num(self.sum)}",
                f"{self.name}_count {self.count}"]
        return out


class Metrics:
    """The server's metrics (thread-safe updates); :meth:`render` gives the exposition text."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.tokens = 0
        self.ttft = Histogram("zerotron_time_to_first_token_seconds",
                              "Seconds from a request's arrival to a row's first generated token.", TTFT_BUCKETS)
        self.tpot = Histogram("zerotron_time_per_output_token_seconds",
                              "Seconds per generated token after the first, per row.", TPOT_BUCKETS)

    def request(self, endpoint: str, code: int) -> None:
        with self.lock:
            self.requests[(endpoint, code)] = self.requests.get((endpoint, code), 0) + 1

    def job(self, job) -> None:
        """Count a finished ``Job``'s tokens and timings (``job.t0``, ``job.first``, ``job.last``)."""
        with self.lock:
            for k, new in enumerate(job.result):
                self.tokens += len(new or ())
                if job.first[k] is not None:
                    self.ttft.observe(job.first[k] - job.t0)
                    if job.ntok[k] > 1:
                        self.tpot.observe((job.last[k] - job.first[k]) / (job.ntok[k] - 1))

    def render(self, queue_depth: int, running: int, cancelled: int, stats=None) -> str:
        """The exposition text; ``stats``: the front's ``ServeStats`` (paged-cache figures)."""
        with self.lock:
            out = ["# HELP zerotron_requests_total HTTP requests answered, by endpoint and status code.",
                   "# TYPE zerotron_requests_total counter"]
            out += [f'zerotron_requests_total{{endpoint="{e}",code="{c}"}} {n}'
                    for (e, c), n in sorted(self.requests.items())]
            for name, kind, doc, v in (
                    ("zerotron_queue_depth", "gauge", "Rows submitted that have no generated token yet.", queue_depth),
                    ("zerotron_running_rows", "gauge", "Rows in the continuous batch now.", running),
                    ("zerotron_generated_tokens_total", "counter", "Tokens generated for answered requests.",
                     self.tokens),
                    ("zerotron_cancelled_rows_total", "counter", "Rows dropped: their client disconnected.",
                     cancelled),
                    ("zerotron_kv_blocks_used", "gauge", "Paged KV cache blocks referenced by rows.",
                     getattr(stats, "kv_blocks_used", 0)),
                    ("zerotron_kv_blocks_free", "gauge", "Paged KV cache blocks free or holding evictable prefixes.",
                     getattr(stats, "kv_blocks_free", 0)),
                    ("zerotron_kv_slots_allocated", "gauge", "Token slots of the KV blocks referenced by rows.",
                     getattr(stats, "kv_slots_allocated", 0)),
                    ("zerotron_kv_slots_filled", "gauge",
                     "Token slots holding a cached token in the KV blocks referenced by rows.",
                     getattr(stats, "kv_slots_filled", 0)),
                    ("zerotron_prefix_cache_hits_total", "counter", "Full prompt blocks found in the prefix cache.",
                     getattr(stats, "prefix_hits", 0)),
                    ("zerotron_prefix_cache_misses_total", "counter",
                     "Full prompt blocks not found in the prefix cache.", getattr(stats, "prefix_misses", 0)),
                    ("zerotron_preemptions_total", "counter", "Rows preempted when the KV pool ran out.",
                     getattr(stats, "preemptions", 0)),
                    ("zerotron_spec_proposed_tokens_total", "counter", "Draft tokens proposed (speculative decoding).",
                     getattr(stats, "spec_proposed", 0)),
                    ("zerotron_spec_accepted_tokens_total", "counter", "Draft tokens accepted by the target model.",
                     getattr(stats, "spec_accepted", 0)),
                    ("zerotron_spec_acceptance_rate", "gauge", "Accepted / proposed draft tokens (0 before any).",
                     _num(getattr(stats, "spec_accepted", 0) / max(getattr(stats, "spec_proposed", 0), 1)))):
                out += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", f"{name} {v}"]
            out += self.ttft.lines() + self.tpot.lines()
        return "\n".join(out) + "\n"
