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

Run by a group of hosts, every host runs this same loop in lockstep
(edgemoe.serving.lockstep). With a draft, a request decoded alone speculates
(edgemoe.serving.speculation).

MLX streams belong to the thread that made them (`mx.new_stream` from another thread is a
RuntimeError), so the model is loaded and run on the engine thread only; the HTTP layer
talks to it through `submit` and `cancel`, and receives events through each job's `emit` callback.
"""

import gc
import logging
import queue
import threading
import time
from collections import deque
from typing import Callable, List, Optional

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..distributed import GroupError
from ..mlx_backend.experts import streaming_of
from ..mlx_backend.state import RoutingState, bind, sequence_state
from . import sampling
from .job import Job
from .limits import IdleTrim
from .lockstep import fatal_in_group, follow, share_turn
from .metrics import Metrics
from .outcomes import Health, advance, fail_jobs, fail_row
from .prompt_cache import PromptCache
from .speculation import speculates, speculative_step

log = logging.getLogger("edgemoe.server")


class Engine:
    """Owns the model; runs prefill chunks and batched decode steps on one thread."""

    def __init__(self, load: Callable[[], tuple], max_batch: int = 8,
                 prefill_step_size: int = 2048, max_waiting: int = 256,
                 prompt_cache_size: int = 10, prompt_cache_bytes: Optional[int] = None,
                 load_draft: Optional[Callable] = None, prompt_cache_disk=None):
        """`prompt_cache_size` / `prompt_cache_bytes`: the most KV caches (and bytes of
        them) kept for reuse by later requests that share their prefix (mlx-lm's
        LRUPromptCache); 0 entries: none kept. `load_draft(tokenizer)`: the draft
        (a DraftModel or PromptLookup) that requests decoded alone speculate with.
        `prompt_cache_disk()`: opens the cache's folder on disk (serving.prompt_cache)."""
        self._load = load  # returns (model, tokenizer, config); called on the engine thread
        self._load_draft = load_draft
        self.drafting = load_draft is not None
        self.draft = None
        self.prompt_cache = PromptCache(max(prompt_cache_size, 1),
                                        prompt_cache_bytes or 1 << 63, prompt_cache_disk) \
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
        self.stopping = threading.Event()
        self.store = None  # the model's ExpertStore, once loaded
        self.share = None  # the model's HostShare when it is one host of a group
        self.experts_per_token = None  # its routing.modes.ExpertsPerToken, once loaded
        self.thread = threading.Thread(target=self._run, name="edgemoe-engine", daemon=True)
        self.health = Health()  # /health's word on the server's own failures

    # ---- HTTP side -------------------------------------------------------------
    def start(self, timeout: Optional[float] = None):
        self.thread.start()
        self.ready.wait(timeout)
        if self.load_error is not None:
            raise self.load_error

    def stop(self):
        self.stopping.set()
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
        store = self.store
        return store is None or store.healthy()

    def waiting(self) -> int:
        return self.inbox.qsize() + len(self.pending)

    def submit(self, job: Job) -> bool:
        """Queue a job; False when too many are waiting already."""
        if self.waiting() >= self.max_waiting:
            return False
        self.metrics.add(submitted=1)
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
            streaming = streaming_of(self.model)
            self.store, self.share = streaming.store, streaming.share
            self.experts_per_token = streaming.experts_per_token
            self.metrics = Metrics(self.store)
            self.eos = set(self.tokenizer.eos_token_ids)
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
        trim = IdleTrim()
        while True:
            if not self.active and not self.pending:
                trim()  # idle: what finished requests freed goes back to the system
            if self.leader:
                new = self._admit(block=not self.active and not self.pending)
            if self.share is None:
                if self.stopping.is_set():
                    return
                self._drop_cancelled()
            else:
                go_on, cancelled = share_turn(self, new if self.leader else [])
                if not go_on:
                    return
                self._drop_cancelled(cancelled)
            tic = time.perf_counter()
            if self.pending and len(self.active) < self.max_batch:
                job = self.pending[0]
                try:
                    self._prefill_chunk(job)
                except Exception as e:
                    fatal_in_group(self, e)
                    log.exception("request %s: prefill failed", job.id)
                    fail_jobs(self, [job], f"request {job.id}: prompt processing failed: "
                                           f"{type(e).__name__}: {e}")
            if self.active:
                try:
                    self._step()
                except Exception as e:  # a failed step poisons the batch: fail its rows
                    fatal_in_group(self, e)
                    log.exception("decode step failed")
                    fail_jobs(self, list(self.active),
                              f"generation failed: {type(e).__name__}: {e}")
            if self.active or self.pending:
                self.metrics.add(busy_s=time.perf_counter() - tic)

    def _release(self):
        """Free the model's arrays and this thread's streams on this thread: with
        mlx 0.32.4 a process whose MLX worker thread ended without this aborts at
        exit now and then ("terminate called without an active exception")."""
        self._fail_all("the server is stopping")
        if self.store is not None:
            self.store.close()
        self.model = self.batch_cache = self.store = None
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
        for job in [j for j in [*self.pending, *self.active] if gone(j)]:
            log.info("request %s cancelled after %d tokens", job.id, len(job.tokens))
            self.metrics.add(cancelled=1)
            if job in self.pending:
                self.pending.remove(job)
        keep = [i for i, j in enumerate(self.active) if not gone(j)]
        if len(keep) < len(self.active):
            self.keep_rows(keep)

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
                    job.prompt_top += [sampling.top_logprobs(row, job.top_logprobs)
                                       for row in scores]
            mx.eval([c.state for c in job.cache])
            self.metrics.count(self.metrics.prefill, before)
            self.metrics.add(prefilled_tokens=end - job.prefilled)
            job.prefilled = end
        if job.prefilled >= len(job.prompt) - 1:
            self.pending.popleft()
            if job.use_prompt_cache:
                self._remember(job.prompt[:-1], job.cache, job.cache_scope)
            self._join_batch(job)

    def _start_prefill(self, job: Job):
        """The job's cache: the nearest cached prefix of its prompt, or a new one."""
        if job.detokenizer is None:  # (a completion brings one that keeps leading spaces)
            job.detokenizer = self.tokenizer.detokenizer
        job.sampler = sampling.make_request_sampler(**job.sampling) if job.sampling else None
        sampling.prefetch_masks([job])  # its first mask, computed during its prefill
        job.prompt_scores = [None]  # the first token has no logprob
        job.prompt_top = [None]
        reuse = self.prompt_cache is not None and job.use_prompt_cache
        cache, rest = self.prompt_cache.fetch(job.prompt[:-1], job.cache_scope) if reuse else \
            (None, job.prompt[:-1])
        job.cache = cache if cache is not None else make_prompt_cache(self.model)
        job.prefilled = job.cached_tokens = len(job.prompt) - 1 - len(rest)
        if reuse:
            self.metrics.add(cache_hits=job.cached_tokens > 0,
                             cache_misses=job.cached_tokens == 0, cached_tokens=job.cached_tokens)

    def _remember(self, tokens: List[int], cache: list, scope: str = ""):
        """Keep `cache` (of `tokens`, all prefilled) for `scope`'s requests starting so."""
        if self.prompt_cache is None or not tokens:
            return
        self.prompt_cache.insert(tokens, cache, scope)
        with self.metrics.lock:
            self.metrics.cache_entries = len(self.prompt_cache)
            self.metrics.cache_bytes = self.prompt_cache.nbytes

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
        self.metrics.add(prompt_tokens=len(job.prompt))

    def keep_rows(self, keep: List[int]):
        self.active = [self.active[i] for i in keep]
        if not self.active:
            self.batch_cache = self.batch_routing = None
        elif self.batch_cache is not None:
            index = mx.array(keep)
            for c in self.batch_cache:
                c.filter(index)
            self.batch_routing.filter(keep)

    def _step(self):
        if speculates(self):
            return speculative_step(self, self.active[0])
        before = self.metrics.store_stats()
        sampling.prefetch_masks(self.active)  # computed while the forward runs
        inputs = mx.array([[j.next_input] for j in self.active])
        logits = self.model(inputs, cache=self.batch_cache)[:, -1, :]
        since = None
        if self.leader and any(j.grammar is not None for j in self.active):
            mx.eval(logits)  # the forward, beside the masks; they are waited for from here
            since = time.perf_counter()
        if not self.leader:  # the leader chooses; this host follows
            mx.eval(logits, [c.state for c in self.batch_cache])
            outcome = self.share.broadcast(None, "sharing the tokens")
            follow(self, outcome["tokens"], outcome["keep"])
            return
        failed = {}
        logits = sampling.process(self.active, logits, failed, since)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        greedy = mx.argmax(logprobs, axis=-1)
        usable = sampling.usable(logprobs)
        mx.eval(greedy, logprobs, usable, [c.state for c in self.batch_cache])
        tokens = greedy.tolist()
        for i, ok in enumerate(usable.tolist()):
            if not ok and i not in failed:
                failed[i] = sampling.row_failed(self.active[i], "sampling",
                                                sampling.NOT_FINITE)
        now = time.perf_counter()
        keep, generated = [], 0
        for i, job in enumerate(self.active):
            if i in failed:
                continue
            # every per-row stage runs inside the row's own boundary: whatever its
            # sampler, grammar, detokenizer, stop strings or client do, the row ends
            # alone and the batch goes on
            try:
                tokens[i], chosen, top = sampling.pick(job, logprobs[i:i + 1], tokens[i])
            except sampling.RowError as e:
                failed[i] = str(e)
                continue
            if job.first_token_at is None:
                job.first_token_at = now
            generated += 1
            try:
                if not advance(self, job, tokens[i], chosen, top):
                    keep.append(i)
            except Exception as e:
                failed[i] = sampling.row_failed(job, "advancing", e)
        self.metrics.count(self.metrics.decode, before)
        self.metrics.count_step(len(self.active), generated)
        for i in sorted(failed):
            fail_row(self, self.active[i], failed[i])
        if self.share is not None:
            self.share.broadcast({"tokens": tokens, "keep": keep}, "sharing the tokens")
        if len(keep) < len(self.active):
            self.keep_rows(keep)

    def _fail_all(self, message: str):
        fail_jobs(self, self.active + list(self.pending), message)
