"""The engine's counters, which the HTTP side reads for /metrics (under a lock)."""

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, fields

import mlx.core as mx

from ..streaming.stats import ExpertStats

log = logging.getLogger("edgemoe.server")


@dataclass
class Finished:
    latency_s: float
    ttft_s: float
    prompt_tokens: int
    generated: int


class Metrics:
    """Counters the engine updates and the HTTP side reads (under a lock). Expert figures
    are the store's own counters (edgemoe.streaming.stats), so they mean what
    `edgemoe.generate` prints."""

    def __init__(self, store):
        self.lock = threading.Lock()
        self.store = store
        self.info = store.info()
        self.started = time.time()
        self.submitted = self.completed = self.cancelled = self.failed = 0
        self.prompt_tokens = self.generated_tokens = 0
        self.steps = self.step_rows = self.max_batch_seen = 0
        self.busy_s = 0.0  # engine time spent prefilling or decoding
        self.prefill = ExpertStats()  # prefill chunks only
        self.prefilled_tokens = 0  # prompt tokens run through the model
        self.cache_hits = self.cache_misses = self.cached_tokens = 0
        self.cache_entries = self.cache_bytes = 0
        self.decode = ExpertStats()  # decode steps only
        self.windows = self.drafted = self.accepted = 0  # speculative steps and their drafts
        self.recent = deque(maxlen=1000)  # Finished, newest last
        self._last_stats = store.snapshot()

    def add(self, **counts):
        """Add each of `counts` to the counter of its name."""
        with self.lock:
            self._add(counts)

    def count_step(self, rows: int, generated: int, **counts):
        """One decode step (or speculative window) of `rows` rows."""
        with self.lock:
            self.max_batch_seen = max(self.max_batch_seen, rows)
            self._add(dict(steps=1, step_rows=rows, generated_tokens=generated, **counts))

    def _add(self, counts: dict):
        for name, n in counts.items():
            setattr(self, name, getattr(self, name) + n)

    def store_stats(self) -> ExpertStats:
        """A consistent copy of the store's counters (the last one once it is closed)."""
        if self.store is not None:
            self._last_stats = self.store.snapshot()
        return self._last_stats

    def count(self, into: ExpertStats, before: ExpertStats):
        """Add the store's counters since `before` to `into`."""
        delta = self.store_stats() - before
        with self.lock:
            for f in fields(ExpertStats):
                setattr(into, f.name, getattr(into, f.name) + getattr(delta, f.name))

    def snapshot(self, active: int, waiting: int) -> dict:
        s = self.store_stats()
        with self.lock:
            lat = sorted(f.latency_s for f in self.recent)
            ttft = sorted(f.ttft_s for f in self.recent)
            gen, busy, decode = self.generated_tokens, self.busy_s, self.decode.copy()
            prefill, computed = self.prefill.copy(), self.prefilled_tokens
            per_token = prefill.bytes_read / computed if computed else 0.0
            return {
                "uptime_s": round(time.time() - self.started, 3),
                "requests": {"submitted": self.submitted, "completed": self.completed,
                             "cancelled": self.cancelled, "failed": self.failed,
                             "active": active, "waiting": waiting},
                "tokens": {"prompt": self.prompt_tokens, "generated": gen,
                           "busy_s": round(busy, 4),
                           "tok_per_s": round(gen / busy, 3) if busy else 0.0},
                "batch": {"steps": self.steps, "rows": self.step_rows,
                          "mean_size": round(self.step_rows / self.steps, 3)
                          if self.steps else 0.0,
                          "max_size_seen": self.max_batch_seen},
                "speculative": {"windows": self.windows, "drafted": self.drafted,
                                "accepted": self.accepted,
                                "acceptance": round(self.accepted / self.drafted, 4)
                                if self.drafted else 0.0},
                # a hit's tokens skip prefill, and with it the expert reads that prefill
                # makes: estimated at the mean expert bytes read per prefilled token
                "prompt_cache": {"hits": self.cache_hits, "misses": self.cache_misses,
                                 "cached_tokens": self.cached_tokens,
                                 "entries": self.cache_entries, "bytes": self.cache_bytes,
                                 "prefilled_tokens": computed,
                                 "prefill_bytes_read": prefill.bytes_read,
                                 "bytes_read_saved_estimate":
                                     round(per_token * self.cached_tokens)},
                # what MLX holds: arrays alive, and freed buffers kept for reuse (given
                # back when the server is idle)
                "memory": {"mlx_active_bytes": mx.get_active_memory(),
                           "mlx_cache_bytes": mx.get_cache_memory()},
                "latency_s": {"count": len(lat), "p50": _pct(lat, 50), "p95": _pct(lat, 95),
                              "ttft_p50": _pct(ttft, 50), "ttft_p95": _pct(ttft, 95)},
                # requests count distinct experts per layer per forward call (the union
                # over the batch); bytes_used is what compute read from slots, bytes_reused
                # what of it was already in memory (edgemoe.streaming.stats)
                "experts": {**_expert_figures(s),
                            "bytes_read_per_token": round(s.bytes_read / gen, 1) if gen else 0.0,
                            "decode": {**_expert_figures(decode),
                                       "bytes_used_per_token": round(decode.bytes_used / gen, 1)
                                       if gen else 0.0},
                            "slots_per_layer": self.info.slots_per_layer,
                            "budget_bytes": self.info.budget_bytes},
            }


def _expert_figures(s: ExpertStats) -> dict:
    return {"requests": s.requests, "hits": s.hits, "late_fills": s.late_fills,
            "on_demand": s.on_demand, "loads": s.loads, "prefetches": s.prefetches,
            "hit_rate": round(s.hit_rate, 4), "bytes_read": s.bytes_read,
            "bytes_reused": s.bytes_hit, "bytes_used": s.bytes_used,
            "evictions": s.evictions, "blocked_s": round(s.blocked_s, 4)}


def _pct(sorted_values, p):
    if not sorted_values:
        return None
    i = min(len(sorted_values) - 1, int(round(p / 100 * (len(sorted_values) - 1))))
    return round(sorted_values[i], 4)


def log_finished(job_id: str, reason: str, done: Finished, m: dict):
    """One line for a request that ended, with the server's figures so far (`m`)."""
    log.info("request %s: %s, prompt %d tok, generated %d tok in %.3f s (first token "
             "%.3f s) | all: %.1f tok/s, batch mean %.2f, experts read %.1f MB, "
             "hit rate %.1f%%", job_id, reason, done.prompt_tokens, done.generated,
             done.latency_s, done.ttft_s, m["tokens"]["tok_per_s"],
             m["batch"]["mean_size"], m["experts"]["bytes_read"] / 1e6,
             100 * m["experts"]["hit_rate"])
