"""The batching engine: one thread runs the model for every request in flight.

Each request is prefilled alone (batch of one, its own KV cache, in chunks), then joins
the decode batch: one step feeds every active request's last token through the model
together, each request's KV cache a row of an mlx-lm `BatchKVCache`. Routing stays per
token; the streaming expert module loads the union of the batch's experts once per
layer. Requests join and leave between steps, so a new request waits at most one step
(plus one prefill chunk of another request) before its own prefill starts.

On the CPU each row of a batched step is bit-identical to the same request decoded
alone (measured over staggered joins and leaves and small budgets; `tests/test_server.py`
checks it): the per-row kernels (quantized matmuls, `gather_qmm`, norms, attention over a
left-padded cache with masked pads) do not mix rows. The prompt's last token is decoded in
the batch, as mlx-lm's `generate_step` decodes it apart from the prefill, so a request's
greedy tokens equal `edgemoe.generate`'s.

Run by a group of hosts (--distributed, edgemoe.distributed), host 0 is the leader: it
alone takes requests, samples and decides when a request ends. Every host runs this same
loop in lockstep: at each turn the leader shares the requests that arrived or were
cancelled (`_share_turn`), all hosts run the same prefill chunk and decode step (their
MoE layers sum each host's experts), and the leader shares the tokens it chose and the
rows that go on (`_share_outcome`). A forward pass that fails on one host leaves the
others waiting inside it, so in a group that is fatal: the engine stops, and the other
hosts' group timeout ends them with an error naming this one.

With a draft (`--draft-model` or `--prompt-lookup`), a request decoded alone speculates:
each step drafts a few tokens and verifies them in one forward call of the target over
the window, keeping the tokens the target itself chooses at each position (mlx-lm's
accept rule, each position sampled with the request's own sampler and key, so greedy and
seeded output are the request's without a draft). A batch of two or more decodes one
token per row, as without a draft: speculation pays where a step is dear, and a batch
already shares each step's reads. The draft length adapts per request
(edgemoe.model.drafts.DraftLength).

MLX streams belong to the thread that made them (`mx.new_stream` from another thread is a
RuntimeError), so the model is loaded and run on the engine thread only; the HTTP layer
talks to it through `submit` and `cancel`, and receives events through each job's `emit` callback.
"""

import gc
import logging
import math
import queue
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Callable, List, Optional

import mlx.core as mx
from mlx_lm.models.cache import (LRUPromptCache, can_trim_prompt_cache, make_prompt_cache,
                                 trim_prompt_cache)
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from ..distributed import GroupError
from ..routing.state import RoutingState, bind, sequence_state
from ..streaming.stats import ExpertStats

log = logging.getLogger("edgemoe.server")


@dataclass(eq=False)  # jobs are compared by identity
class Job:
    """One request as the engine sees it: tokens in, events out."""

    id: str
    prompt: List[int]
    max_tokens: int
    emit: Callable[[dict], None]  # called on the engine thread; must not block
    sampling: Optional[dict] = None  # make_request_sampler's arguments; None: greedy
    stop: List[str] = field(default_factory=list)
    want_logprobs: bool = False
    top_logprobs: int = 0  # the most likely tokens reported beside each chosen one
    processors: list = field(default_factory=list)  # mlx-lm logits processors (penalties,
    #                                                  logit_bias): f(tokens, logits) -> logits
    grammar: object = None  # a constrain.Grammar the tokens must follow; None: free
    prompt_logprobs: bool = False  # the logprob of each prompt token (completions echo)
    use_prompt_cache: bool = True
    received: float = field(default_factory=time.perf_counter)
    cancelled: bool = False  # set by the HTTP side; the engine drops the job between steps
    # engine-side state (MLX arrays are made on the engine thread only)
    sampler: Optional[Callable] = None
    cache: Optional[list] = None
    prefilled: int = 0
    next_input: int = -1
    tokens: List[int] = field(default_factory=list)
    detokenizer: object = None
    text: str = ""
    sent: int = 0  # characters of `text` already emitted
    first_token_at: Optional[float] = None
    stop_hit: Optional[str] = None  # the stop string that ended the job
    cached_tokens: int = 0  # prompt tokens whose KV cache came from the prompt cache
    prompt_scores: List[Optional[float]] = field(default_factory=list)
    prompt_top: list = field(default_factory=list)  # each prompt token's top_logprobs
    draft: object = None  # the draft's state for this sequence (its for_sequence())
    num_draft_tokens: Optional[int] = None  # a window's drafts, fixed; None: DraftLength's


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

    def store_stats(self) -> ExpertStats:
        """A consistent copy of the store's counters (the last one once it is closed)."""
        if self.store is not None:
            self._last_stats = self.store.snapshot()
        return self._last_stats

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


class Engine:
    """Owns the model; runs prefill chunks and batched decode steps on one thread."""

    def __init__(self, load: Callable[[], tuple], max_batch: int = 8,
                 prefill_step_size: int = 2048, max_waiting: int = 256,
                 prompt_cache_size: int = 10, prompt_cache_bytes: Optional[int] = None,
                 load_draft: Optional[Callable] = None):
        """`prompt_cache_size` / `prompt_cache_bytes`: the most KV caches (and bytes of
        them) kept for reuse by later requests that share their prefix (mlx-lm's
        LRUPromptCache); 0 entries: none kept. `load_draft(tokenizer)`: the draft
        (a DraftModel or PromptLookup) that requests decoded alone speculate with."""
        self._load = load  # returns (model, tokenizer, config); called on the engine thread
        self._load_draft = load_draft
        self.drafting = load_draft is not None
        self.draft = None
        self.prompt_cache = LRUPromptCache(max(prompt_cache_size, 1),
                                           prompt_cache_bytes or 1 << 63) \
            if prompt_cache_size > 0 else None
        self.max_batch = max_batch
        self.prefill_step_size = prefill_step_size
        self.max_waiting = max_waiting
        self.inbox: "queue.Queue[Job]" = queue.Queue()
        self.pending: deque = deque()  # admitted, waiting for or in prefill (FIFO)
        self.active: List[Job] = []    # rows of the decode batch, in cache order
        self.batch_cache = None
        self.batch_routing: Optional[RoutingState] = None  # the rows' routing, as their caches
        self.model = self.tokenizer = self.config = self.metrics = None
        self.ready = threading.Event()
        self.load_error: Optional[BaseException] = None
        self._stop = threading.Event()
        self.share = None  # the model's HostShare when it is one host of a group
        self.thread = threading.Thread(target=self._run, name="edgemoe-engine", daemon=True)

    # ---- HTTP side -------------------------------------------------------------
    def start(self, timeout: Optional[float] = None):
        self.thread.start()
        self.ready.wait(timeout)
        if self.load_error is not None:
            raise self.load_error

    def stop(self):
        self._stop.set()
        self.thread.join(timeout=10)

    @property
    def leader(self) -> bool:
        """Whether this engine takes requests: alone, or host 0 of a group."""
        return self.share is None or self.share.rank == 0

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and self.ready.is_set() and self.load_error is None

    def store_healthy(self) -> bool:
        """False while an expert read is stuck past the read timeout (any thread may ask)."""
        store = getattr(self.model, "expert_store", None)
        return store is None or store.healthy()

    def waiting(self) -> int:
        return self.inbox.qsize() + len(self.pending)

    def submit(self, job: Job) -> bool:
        """Queue a job; False when too many are waiting already."""
        if self.waiting() >= self.max_waiting:
            return False
        with self.metrics.lock:
            self.metrics.submitted += 1
        self.inbox.put(job)
        return True

    @staticmethod
    def cancel(job: Job):
        job.cancelled = True

    def snapshot(self) -> dict:
        return self.metrics.snapshot(len(self.active), self.waiting())

    # ---- engine thread ---------------------------------------------------------
    def _run(self):
        try:
            self.model, self.tokenizer, self.config = self._load()
            self.metrics = Metrics(self.model.expert_store)
            self.eos = set(self.tokenizer.eos_token_ids)
            self.share = getattr(self.model, "host_share", None)
            if self._load_draft is not None:
                self.draft = self._load_draft(self.tokenizer)
        except BaseException as e:  # reported by start()
            self.load_error = e
            gc.collect()
            mx.clear_streams()
            self.ready.set()
            return
        self.ready.set()
        try:
            self._serve()
        except GroupError as e:  # the group is gone: so is every request
            log.error("%s", e)
            self._fail_all(f"the server lost a host: {e}")
        self._release()

    def _serve(self):
        while True:
            if self.leader:
                new = self._admit(block=not self.active and not self.pending)
            if self.share is None:
                if self._stop.is_set():
                    return
                self._drop_cancelled()
            else:
                go_on, cancelled = self._share_turn(new if self.leader else [])
                if not go_on:
                    return
                self._drop_cancelled(cancelled)
            tic = time.perf_counter()
            if self.pending and len(self.active) < self.max_batch:
                job = self.pending[0]
                try:
                    self._prefill_chunk(job)
                except Exception as e:
                    self._fatal_in_group(e)
                    log.exception("request %s: prefill failed", job.id)
                    self._fail([job], f"request {job.id}: prompt processing failed: "
                                      f"{type(e).__name__}: {e}")
            if self.active:
                try:
                    self._step()
                except Exception as e:  # a failed step poisons the batch: fail its rows
                    self._fatal_in_group(e)
                    log.exception("decode step failed")
                    self._fail(list(self.active),
                               f"generation failed: {type(e).__name__}: {e}")
            if self.active or self.pending:
                with self.metrics.lock:
                    self.metrics.busy_s += time.perf_counter() - tic

    def _fatal_in_group(self, e: Exception):
        """In a group, a failed forward pass stops this engine (see the module doc)."""
        if self.share is None:
            return
        if isinstance(e, GroupError):
            raise e
        raise GroupError(f"{self.share.watch.me}: a forward pass failed here "
                         f"({type(e).__name__}: {e}); the group cannot go on without "
                         f"this host") from e

    # ---- a group's turns (leader: host 0) ----------------------------------------
    SPEC = ("id", "prompt", "max_tokens", "use_prompt_cache")  # what followers need of a job

    def _share_turn(self, new: List[Job]):
        """The leader tells the others which requests arrived and which were cancelled
        (or that the server stops); the others add the same. (go on, the ids every host
        drops now: a cancellation that comes later waits for the next turn)."""
        turn = None
        if self.leader:
            cancelled = [j.id for j in [*self.pending, *self.active] if j.cancelled]
            turn = {"stop": self._stop.is_set(), "cancelled": cancelled,
                    "new": [{k: getattr(j, k) for k in self.SPEC} for j in new]}
        turn = self.share.broadcast(turn, "sharing the requests")
        if not self.leader:
            for spec in turn["new"]:
                self.pending.append(Job(emit=lambda event: None, **spec))
        return not turn["stop"], set(turn["cancelled"])

    def _release(self):
        """Free the model's arrays and this thread's streams on this thread: with
        mlx 0.32.4 a process whose MLX worker thread ended without this aborts at
        exit now and then ("terminate called without an active exception")."""
        self._fail_all("the server is stopping")
        store = getattr(self.model, "expert_store", None)
        if store is not None:
            store.close()
        self.model = self.batch_cache = None
        self.metrics.store = None
        gc.collect()
        mx.synchronize()
        mx.clear_streams()

    def _admit(self, block: bool) -> List[Job]:
        """Move the jobs submitted since into `pending`; return them."""
        new = []
        try:
            job = self.inbox.get(timeout=0.1) if block else self.inbox.get_nowait()
            while True:
                new.append(job)
                job = self.inbox.get_nowait()
        except queue.Empty:
            pass
        self.pending.extend(new)
        return new

    def _drop_cancelled(self, ids: Optional[set] = None):
        """Drop the cancelled jobs (in a group: those whose `ids` the leader shared)."""
        gone = (lambda j: j.cancelled) if ids is None else (lambda j: j.id in ids)
        for job in [j for j in self.pending if gone(j)]:
            self.pending.remove(job)
            self._count_cancelled(job)
        keep = [i for i, j in enumerate(self.active) if not gone(j)]
        if len(keep) < len(self.active):
            for i, j in enumerate(self.active):
                if gone(j):
                    self._count_cancelled(j)
            self._keep_rows(keep)

    def _count_cancelled(self, job: Job):
        log.info("request %s cancelled after %d tokens", job.id, len(job.tokens))
        with self.metrics.lock:
            self.metrics.cancelled += 1

    def _prefill_chunk(self, job: Job):
        """Run one chunk of `job`'s prompt (all but its last token) alone."""
        if job.cache is None:
            self._start_prefill(job)
        end = min(job.prefilled + self.prefill_step_size, len(job.prompt) - 1)
        if end > job.prefilled:
            before = self.metrics.store_stats()
            logits = self.model(mx.array(job.prompt[job.prefilled:end])[None],
                                cache=job.cache)
            if job.prompt_logprobs:  # of each next prompt token, the chunk's last too
                nxt = mx.array(job.prompt[job.prefilled + 1:end + 1])
                scores = logits[0] - mx.logsumexp(logits[0], axis=-1, keepdims=True)
                job.prompt_scores += mx.take_along_axis(
                    scores, nxt[:, None], axis=-1)[:, 0].tolist()
                if job.top_logprobs:  # what an evaluation harness checks greediness by
                    job.prompt_top += [_top(row, job.top_logprobs) for row in scores]
            mx.eval([c.state for c in job.cache])
            self._count(self.metrics.prefill, before)
            with self.metrics.lock:
                self.metrics.prefilled_tokens += end - job.prefilled
            job.prefilled = end
        if job.prefilled >= len(job.prompt) - 1:
            self.pending.popleft()
            if job.use_prompt_cache:
                self._remember(job.prompt[:-1], job.cache)
            self._join_batch(job)

    def _start_prefill(self, job: Job):
        """The job's cache: the nearest cached prefix of its prompt, or a new one."""
        if job.detokenizer is None:  # (a completion brings one that keeps leading spaces)
            job.detokenizer = self.tokenizer.detokenizer
        job.sampler = make_request_sampler(**job.sampling) if job.sampling else None
        job.prompt_scores = [None]  # the first token has no logprob
        job.prompt_top = [None]
        cache, rest = self._cached(job.prompt[:-1]) if job.use_prompt_cache else \
            (None, job.prompt[:-1])
        job.cache = cache if cache is not None else make_prompt_cache(self.model)
        job.prefilled = job.cached_tokens = len(job.prompt) - 1 - len(rest)
        if self.prompt_cache is not None and job.use_prompt_cache:
            with self.metrics.lock:
                self.metrics.cache_hits += job.cached_tokens > 0
                self.metrics.cache_misses += job.cached_tokens == 0
                self.metrics.cached_tokens += job.cached_tokens

    def _cached(self, tokens: List[int]):
        """(the KV cache of the longest cached prefix of `tokens`, the tokens after it),
        or (None, tokens). At least two tokens are left to prefill: some families'
        attention computes a one-token call differently from a longer one (deepseek_v3's
        MLA, by 1e-6), and a request must give what it gives alone, where its prefill
        never runs one token after a long chunk. Only prefills are cached, for the same
        reason: a reply's KV, made one token at a time, would differ from the prefill of
        the same tokens in the next turn sent alone."""
        if self.prompt_cache is None or len(tokens) < 3:
            return None, tokens
        cache, rest = self.prompt_cache.fetch_nearest_cache("model", tokens)
        if cache is not None and len(rest) < 2:
            if not can_trim_prompt_cache(cache) or len(tokens) - len(rest) <= 2:
                return None, tokens
            trim_prompt_cache(cache, 2 - len(rest))
            rest = tokens[len(tokens) - 2:]
        return cache, rest

    def _remember(self, tokens: List[int], cache: list):
        """Keep `cache` (of `tokens`, all prefilled) for later requests that start with
        them."""
        if self.prompt_cache is None or not tokens:
            return
        self.prompt_cache.insert_cache("model", list(tokens), cache, cache_type="user")
        with self.metrics.lock:
            self.metrics.cache_entries = len(self.prompt_cache)
            self.metrics.cache_bytes = self.prompt_cache.nbytes

    def _count(self, into: ExpertStats, before: ExpertStats):
        """Add the store's counters since `before` to `into`."""
        delta = self.metrics.store_stats() - before
        with self.metrics.lock:
            for f in fields(ExpertStats):
                setattr(into, f.name, getattr(into, f.name) + getattr(delta, f.name))

    def _join_batch(self, job: Job):
        routing = sequence_state(job.cache)  # what its prefill carries to the next token
        rows = [c.merge([c]) for c in job.cache]  # each layer's cache as a batch of one
        job.cache = None
        job.next_input = job.prompt[-1]
        if self.batch_cache is None:
            self.batch_cache = rows
            self.batch_routing = RoutingState.merge([routing])
            bind(self.batch_cache, self.batch_routing)
        else:
            for batch, row in zip(self.batch_cache, rows):
                batch.extend(row)
            self.batch_routing.extend(routing)
        self.active.append(job)
        with self.metrics.lock:
            self.metrics.prompt_tokens += len(job.prompt)

    def _keep_rows(self, keep: List[int]):
        self.active = [self.active[i] for i in keep]
        if not self.active:
            self.batch_cache = self.batch_routing = None
        elif self.batch_cache is not None:
            index = mx.array(keep)
            for c in self.batch_cache:
                c.filter(index)
            self.batch_routing.filter(keep)

    def _speculates(self) -> bool:
        return (self.draft is not None and len(self.active) == 1 and self.share is None
                and can_trim_prompt_cache(self.batch_cache))

    def _step(self):
        if self._speculates():
            return self._speculative_step(self.active[0])
        before = self.metrics.store_stats()
        inputs = mx.array([[j.next_input] for j in self.active])
        logits = self.model(inputs, cache=self.batch_cache)[:, -1, :]
        if not self.leader:  # the leader chooses; this host follows
            mx.eval(logits, [c.state for c in self.batch_cache])
            outcome = self.share.broadcast(None, "sharing the tokens")
            self._follow(outcome["tokens"], outcome["keep"])
            return
        failed = {}
        logits = self._process(logits, failed)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        greedy = mx.argmax(logprobs, axis=-1)
        usable = _usable(logprobs)
        mx.eval(greedy, logprobs, usable, [c.state for c in self.batch_cache])
        tokens = greedy.tolist()
        for i, ok in enumerate(usable.tolist()):
            if not ok and i not in failed:
                failed[i] = self._row_failed(self.active[i], "sampling", _NOT_FINITE)
        now = time.perf_counter()
        keep, generated = [], 0
        for i, job in enumerate(self.active):
            if i in failed:
                continue
            # every per-row stage runs inside the row's own boundary: whatever its
            # sampler, grammar, detokenizer, stop strings or client do, the row ends
            # alone and the batch goes on
            stage = "sampling"
            try:
                if job.sampler is not None:
                    tokens[i] = _token(job.sampler(logprobs[i:i + 1]), logprobs.shape[-1])
                chosen = _finite(logprobs[i, tokens[i]].item(), tokens[i])
                stage = "top logprobs"
                top = _top(logprobs[i], job.top_logprobs) if job.top_logprobs else None
                if job.first_token_at is None:
                    job.first_token_at = now
                stage = "advancing"
                generated += 1
                if not self._advance(job, tokens[i], chosen, top):
                    keep.append(i)
            except Exception as e:
                failed[i] = self._row_failed(job, stage, e)
        self._count(self.metrics.decode, before)
        with self.metrics.lock:
            self.metrics.steps += 1
            self.metrics.step_rows += len(self.active)
            self.metrics.max_batch_seen = max(self.metrics.max_batch_seen, len(self.active))
            self.metrics.generated_tokens += generated
        for i in sorted(failed):
            self._fail_row(self.active[i], failed[i])
        if self.share is not None:
            self.share.broadcast({"tokens": tokens, "keep": keep}, "sharing the tokens")
        if len(keep) < len(self.active):
            self._keep_rows(keep)

    def _follow(self, tokens: List[int], keep: List[int]):
        """A follower's step: the leader's tokens for the rows that go on."""
        for i in keep:
            self.active[i].tokens.append(tokens[i])
            self.active[i].next_input = tokens[i]
        if len(keep) < len(self.active):
            self._keep_rows(keep)

    def _speculative_step(self, job: Job):
        """Draft, verify the window in one call, keep what the target chooses."""
        history, had = job.prompt + job.tokens, len(job.tokens)
        if job.draft is None:
            job.draft = self.draft.for_sequence()
        job.draft.catch_up(history)  # (tokens it decoded in a batch: not the window's time)
        tic, before = time.perf_counter(), self.metrics.store_stats()
        fixed = job.num_draft_tokens is not None  # the request's own (mlx_lm.server's field)
        arm = job.num_draft_tokens if fixed else self.draft.length.choose()
        guess = job.draft.draft(history, min(arm, job.max_tokens - had - 1))
        window = [job.next_input] + guess
        logits = self.model(mx.array([window]), cache=self.batch_cache)[0]
        mx.eval(logits, [c.state for c in self.batch_cache])
        kept, done, failed = 0, False, None
        for i in range(len(window)):  # each position as the target alone would choose it
            try:
                token, chosen, top = self._choose(job, logits[i:i + 1])
                if job.first_token_at is None:
                    job.first_token_at = time.perf_counter()
                done = self._advance(job, token, chosen, top)
            except Exception as e:
                failed = self._row_failed(job, "advancing", e) \
                    if not isinstance(e, RowError) else str(e)
                break
            if done or i == len(guess) or token != guess[i]:
                break
            kept += 1
        self._count(self.metrics.decode, before)
        with self.metrics.lock:
            self.metrics.steps += 1
            self.metrics.step_rows += 1
            self.metrics.max_batch_seen = max(self.metrics.max_batch_seen, 1)
            self.metrics.generated_tokens += len(job.tokens) - had
            self.metrics.windows += 1
            self.metrics.drafted += len(guess)
            self.metrics.accepted += kept
        if failed is not None or done:
            if failed is not None:
                self._fail_row(job, failed)
            self._keep_rows([])
            return
        emitted = len(job.tokens) - had
        trim_prompt_cache(self.batch_cache, len(window) - emitted)  # the guesses not kept
        job.draft.settle(len(history) + kept)
        if not fixed:
            self.draft.length.record(arm, emitted, time.perf_counter() - tic)

    def _choose(self, job: Job, logits: mx.array):
        """(token, its logprob, top logprobs or None) of one row for `job`; raises
        RowError with the reason when its processing or sampling fails."""
        stage = "logits processing"
        try:
            logits = self._process_row(job, logits)
            stage = "sampling"
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            if not _usable(logprobs).item():
                raise ValueError(_NOT_FINITE)
            token = _token(job.sampler(logprobs) if job.sampler is not None
                           else mx.argmax(logprobs, axis=-1), logprobs.shape[-1])
            stage = "top logprobs"
            top = _top(logprobs[0], job.top_logprobs) if job.top_logprobs else None
            return token, _finite(logprobs[0, token].item(), token), top
        except Exception as e:
            raise RowError(self._row_failed(job, stage, e)) from e

    def _process(self, logits: mx.array, failed: dict) -> mx.array:
        """Each row's logits through its own processors and grammar (other rows are
        left as they are, bit for bit); a row whose processing fails is put in `failed`."""
        rows = [i for i, j in enumerate(self.active) if j.processors or j.grammar]
        if not rows:
            return logits
        parts = [logits[i:i + 1] for i in range(len(self.active))]
        for i in rows:
            job = self.active[i]
            try:
                parts[i] = self._process_row(job, parts[i])
            except Exception as e:
                failed[i] = self._row_failed(job, "logits processing", e)
                parts[i] = logits[i:i + 1]  # the row is dropped; its shape keeps the batch's
        return mx.concatenate(parts)

    @staticmethod
    def _process_row(job: Job, row: mx.array) -> mx.array:
        """One row's logits through the job's processors and grammar."""
        shape = row.shape
        if job.processors:
            history = mx.array(job.prompt + job.tokens)
            for process in job.processors:
                row = process(history, row)
        if job.grammar is not None:
            row = job.grammar.mask(row)
        if not isinstance(row, mx.array) or row.shape != shape:
            raise ValueError(f"a logits processor returned "
                             f"{getattr(row, 'shape', type(row).__name__)}, expected {shape}")
        return row

    @staticmethod
    def _row_failed(job: Job, stage: str, error) -> str:
        """The message of `job`'s own failure at `stage` (logged with its traceback)."""
        if isinstance(error, Exception):
            log.error("request %s: %s failed", job.id, stage, exc_info=error)
            error = f"{type(error).__name__}: {error}"
        else:
            log.error("request %s: %s failed: %s", job.id, stage, error)
        return f"request {job.id}: {stage} failed: {error}"

    def _fail_row(self, job: Job, message: str):
        """One row's own failure: its request ends with an error, the batch goes on
        (the caller drops the row). A client whose emit fails is only logged."""
        with self.metrics.lock:
            self.metrics.failed += 1
        try:
            job.emit({"type": "error", "message": message})
        except Exception:
            log.exception("request %s: its error could not be sent", job.id)

    def _advance(self, job: Job, token: int, logprob: float, top=None) -> bool:
        """Give `job` its next token; True when the job has finished."""
        job.tokens.append(token)
        finish = None
        if token in self.eos:
            finish = "stop"
        else:
            job.detokenizer.add_token(token)
            job.text += job.detokenizer.last_segment
            job.next_input = token
            if job.grammar is not None and job.grammar.accept(token):
                finish = "stop"  # the grammar is complete: nothing more may follow
        if len(job.tokens) >= job.max_tokens:
            finish = finish or "length"
        if finish is not None:  # flush what the detokenizer still holds
            job.detokenizer.finalize()
            job.text += job.detokenizer.last_segment
        text, hit = self._releasable(job, final=finish is not None)
        if hit:
            finish = "stop"
        job.emit({"type": "token", "token": token, "logprob": logprob, "text": text,
                  "top": top})
        if finish is not None:
            self._finish(job, finish)
            return True
        return False

    @staticmethod
    def _releasable(job: Job, final: bool):
        """Text safe to send now: up to a stop string, and never a stop string's start."""
        found = [(at, s) for s in job.stop
                 if (at := job.text.find(s, max(0, job.sent - len(s) + 1))) >= 0]
        if found:
            at, job.stop_hit = min(found)
            text, job.sent = job.text[job.sent:at], at
            return text, True
        end = len(job.text)
        if not final:
            for s in job.stop:  # hold back a suffix that may grow into a stop string
                for n in range(min(len(s) - 1, end - job.sent), 0, -1):
                    if job.text.endswith(s[:n]):
                        end = min(end, len(job.text) - n)
                        break
        text, job.sent = job.text[job.sent:end], end
        return text, False

    def _finish(self, job: Job, reason: str):
        now = time.perf_counter()
        done = Finished(now - job.received, (job.first_token_at or now) - job.received,
                        len(job.prompt), len(job.tokens))
        with self.metrics.lock:
            self.metrics.completed += 1
            self.metrics.recent.append(done)
        job.emit({"type": "done", "finish_reason": reason, "prompt_tokens": len(job.prompt),
                  "completion_tokens": len(job.tokens), "cached_tokens": job.cached_tokens,
                  "prompt_logprobs": job.prompt_scores if job.prompt_logprobs else None,
                  "prompt_top": job.prompt_top if job.prompt_logprobs else None})
        m = self.snapshot()
        log.info("request %s: %s, prompt %d tok, generated %d tok in %.3f s (first token "
                 "%.3f s) | all: %.1f tok/s, batch mean %.2f, experts read %.1f MB, "
                 "hit rate %.1f%%", job.id, reason, done.prompt_tokens, done.generated,
                 done.latency_s, done.ttft_s, m["tokens"]["tok_per_s"],
                 m["batch"]["mean_size"], m["experts"]["bytes_read"] / 1e6,
                 100 * m["experts"]["hit_rate"])

    def _fail_all(self, message: str):
        self._fail(self.active + list(self.pending), message)

    def _fail(self, jobs: List[Job], message: str):
        for job in jobs:
            if job in self.pending:
                self.pending.remove(job)
        if any(job in self.active for job in jobs):
            # the batch's caches are suspect
            self.active, self.batch_cache, self.batch_routing = [], None, None
        with self.metrics.lock:
            self.metrics.failed += len(jobs)
        for job in jobs:
            job.cache = None
            job.emit({"type": "error", "message": message})


class RowError(RuntimeError):
    """One request's own failure, its message already made (Engine._row_failed)."""


_NOT_FINITE = ("its logits are not finite (NaN or +inf, or every token at -inf) after its "
               "penalties, bias and grammar")


def _usable(logprobs: mx.array) -> mx.array:
    """Per row: True when sampling it is sound (no NaN or +inf, one finite token)."""
    bad = mx.any(mx.isnan(logprobs) | (logprobs == mx.inf), axis=-1)
    return mx.logical_not(bad) & mx.isfinite(mx.max(logprobs, axis=-1))


def _token(sampled, vocab: int) -> int:
    """A sampler's token as an id, checked against the vocabulary."""
    token = sampled.reshape(-1).item() if isinstance(sampled, mx.array) else sampled
    if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab:
        raise ValueError(f"the sampler chose {token!r}, expected a token id in [0, {vocab})")
    return token


def _finite(logprob: float, token: int) -> float:
    """A chosen token's logprob, which JSON can carry (no NaN, no infinity)."""
    if not math.isfinite(logprob):
        raise ValueError(f"the sampler chose token {token}, whose logprob is {logprob}")
    return logprob


def _top(logprobs: mx.array, n: int) -> List[tuple]:
    """The `n` most likely (token, logprob) of one row, most likely first; tokens a
    grammar forbids (-inf) are left out (JSON has no infinity)."""
    n = min(n, logprobs.shape[-1])
    ids = mx.argpartition(-logprobs, kth=n - 1)[:n]
    pairs = [p for p in zip(ids.tolist(), logprobs[ids].tolist()) if math.isfinite(p[1])]
    return sorted(pairs, key=lambda p: -p[1])


# Sampling ranges inside which a row's logits stay finite in float32: past them every
# token is equally likely (temperature) or a penalty divides by nearly zero, and the
# row's logits become NaN (1/1e308 is 0 in float32, and -inf * 0 is NaN)
MAX_TEMPERATURE = 1000.0
PENALTY_RANGE = {"repetition_penalty": (1e-3, 1e3), "presence_penalty": (-1e3, 1e3),
                 "frequency_penalty": (-1e3, 1e3)}


def check_sampling(temperature: float = 0.0, penalties: Optional[dict] = None):
    """None, or (the field, the message) of the first sampling value outside the ranges
    above (a repetition penalty of 0 or 1 is off)."""
    if not (isinstance(temperature, (int, float)) and 0 <= temperature <= MAX_TEMPERATURE):
        return "temperature", (f"must be within [0, {MAX_TEMPERATURE:g}] (higher makes "
                               f"every token equally likely), got {temperature}")
    for name, value in (penalties or {}).items():
        if name not in PENALTY_RANGE or value is None or \
                (name == "repetition_penalty" and value in (0, 1)):
            continue
        lo, hi = PENALTY_RANGE[name]
        if not (isinstance(value, (int, float)) and lo <= value <= hi):
            return name, f"must be within [{lo:g}, {hi:g}], got {value}"
    return None


def make_request_sampler(temp: float, top_p: float = 1.0, min_p: float = 0.0,
                         top_k: int = 0, seed: Optional[int] = None) -> Optional[Callable]:
    """mlx-lm's sampling chain, drawing from the request's own random key.

    Each request splits its own key at every step, so what it samples does not depend
    on which requests share its batch; with a `seed` it repeats exactly. None: greedy.
    """
    if temp <= 0:
        return None
    if (bad := check_sampling(temp)) is not None:
        raise ValueError(f"'{bad[0]}' {bad[1]}")
    methods = []
    if 0 < top_p < 1.0:
        methods.append(lambda x: apply_top_p(x, top_p))
    if min_p != 0.0:
        methods.append(lambda x: apply_min_p(x, min_p))
    if top_k > 0:
        methods.append(lambda x: apply_top_k(x, top_k))
    key = [mx.random.key(seed if seed is not None else random.getrandbits(63))]

    def sample(logprobs: mx.array) -> mx.array:
        for method in methods:
            logprobs = method(logprobs)
        key[0], step_key = mx.random.split(key[0])
        return mx.random.categorical(logprobs * (1 / temp), key=step_key)

    return sample
