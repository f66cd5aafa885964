"""One row's logits to its token: the request's processors and grammar, its own sampler
(mlx-lm's chain, drawing from the request's own key), and the checks that make a bad row
fail alone, with a message that names its request and stage."""

import logging
import math
import random
from typing import Callable, List, Optional

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from ..sampling_params import check_sampling, is_greedy, scaled
from .constrain import GrammarError
from .job import Job

log = logging.getLogger("edgemoe.server")


class RowError(RuntimeError):
    """One request's own failure, its message already made (row_failed)."""


NOT_FINITE = ("its logits are not finite (NaN or +inf, or every token at -inf) after its "
               "penalties, bias and grammar")


def usable(logprobs: mx.array) -> mx.array:
    """Per row: True when sampling it is sound (no NaN or +inf, one finite token)."""
    bad = mx.any(mx.isnan(logprobs) | (logprobs == mx.inf), axis=-1)
    return mx.logical_not(bad) & mx.isfinite(mx.max(logprobs, axis=-1))


def token_id(sampled, vocab: int) -> int:
    """A sampler's token as an id, checked against the vocabulary."""
    token = sampled.reshape(-1).item() if isinstance(sampled, mx.array) else sampled
    if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab:
        raise ValueError(f"the sampler chose {token!r}, expected a token id in [0, {vocab})")
    return token


def finite(logprob: float, token: int) -> float:
    """A chosen token's logprob, which JSON can carry (no NaN, no infinity)."""
    if not math.isfinite(logprob):
        raise ValueError(f"the sampler chose token {token}, whose logprob is {logprob}")
    return logprob


def top_logprobs(logprobs: mx.array, n: int) -> List[tuple]:
    """The `n` most likely (token, logprob) of one row, most likely first; tokens a
    grammar forbids (-inf) are left out (JSON has no infinity)."""
    n = min(n, logprobs.shape[-1])
    ids = mx.argpartition(-logprobs, kth=n - 1)[:n]
    pairs = [p for p in zip(ids.tolist(), logprobs[ids].tolist()) if math.isfinite(p[1])]
    return sorted(pairs, key=lambda p: -p[1])


def make_request_sampler(temp: float, top_p: float = 1.0, min_p: float = 0.0,
                         top_k: int = 0, seed: Optional[int] = None) -> Optional[Callable]:
    """mlx-lm's sampling chain, drawing from the request's own random key.

    Each request splits its own key at every step, so what it samples does not depend
    on which requests share its batch; with a `seed` it repeats exactly. None: greedy
    (also where the values' limit is greedy: edgemoe.sampling_params).
    """
    if is_greedy(temp, top_p, top_k):
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
        return mx.random.categorical(scaled(logprobs, temp), key=step_key)

    return sample


def choose(job: Job, logits: mx.array):
    """(token, its logprob, top logprobs or None) of one row for `job`; raises
    RowError with the reason when its processing or sampling fails."""
    stage = "logits processing"
    try:
        logits = process_row(job, logits)
        stage = "sampling"
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if not usable(logprobs).item():
            raise ValueError(NOT_FINITE)
        token = token_id(job.sampler(logprobs) if job.sampler is not None
                         else mx.argmax(logprobs, axis=-1), logprobs.shape[-1])
        stage = "top logprobs"
        top = top_logprobs(logprobs[0], job.top_logprobs) if job.top_logprobs else None
        return token, finite(logprobs[0, token].item(), token), top
    except Exception as e:
        raise RowError(row_failed(job, stage, e)) from e


def pick(job: Job, logprobs: mx.array, greedy: int):
    """(token, its logprob, top logprobs or None) of one row of a batch, its logprobs
    processed and checked, `greedy` its argmax; raises RowError as `choose` does."""
    stage = "sampling"
    try:
        token = greedy if job.sampler is None else \
            token_id(job.sampler(logprobs), logprobs.shape[-1])
        chosen = finite(logprobs[0, token].item(), token)
        stage = "top logprobs"
        top = top_logprobs(logprobs[0], job.top_logprobs) if job.top_logprobs else None
        return token, chosen, top
    except Exception as e:
        raise RowError(row_failed(job, stage, e)) from e


def prefetch_masks(jobs: List[Job]):
    """Start each grammar row's next mask on a grammar thread (constrain), so that it is
    computed while the model's forward pass runs."""
    for job in jobs:
        if (prefetch := getattr(job.grammar, "prefetch", None)) is not None:
            prefetch()


def process(jobs: List[Job], logits: mx.array, failed: dict,
            since: Optional[float] = None) -> mx.array:
    """Each row's logits through its own processors and grammar (other rows are
    left as they are, bit for bit); a row whose processing fails is put in `failed`.
    `since`: when the step's forward ended, from which grammar masks are waited for
    within their budget (constrain.Grammar.bits)."""
    rows = [i for i, j in enumerate(jobs) if j.processors or j.grammar]
    if not rows:
        return logits
    parts = [logits[i:i + 1] for i in range(len(jobs))]
    for i in rows:
        job = jobs[i]
        try:
            parts[i] = process_row(job, parts[i], since)
        except Exception as e:
            failed[i] = row_failed(job, "logits processing", e)
            parts[i] = logits[i:i + 1]  # the row is dropped; its shape keeps the batch's
    return mx.concatenate(parts)


def process_row(job: Job, row: mx.array, since: Optional[float] = None) -> mx.array:
    """One row's logits through the job's processors and grammar."""
    shape = row.shape
    if job.processors:
        history = mx.array(job.prompt + job.tokens)
        for processor in job.processors:
            row = processor(history, row)
    if job.grammar is not None:
        row = job.grammar.mask(row, since)
    if not isinstance(row, mx.array) or row.shape != shape:
        raise ValueError(f"a logits processor returned "
                         f"{getattr(row, 'shape', type(row).__name__)}, expected {shape}")
    return row


class RowFailure(str):
    """A row's failure message; `client`: caused by the request itself (its grammar),
    answered as a 400 naming `param`, not as the server's 500."""
    client, param = False, None


def row_failed(job: Job, stage: str, error) -> str:
    """The message of `job`'s own failure at `stage` (logged with its traceback)."""
    client = isinstance(error, GrammarError)
    if client:  # the request's own grammar: no traceback to keep
        log.warning("request %s: %s failed: %s", job.id, stage, error)
        error = f"{type(error).__name__}: {error}"
    elif isinstance(error, Exception):
        log.error("request %s: %s failed", job.id, stage, exc_info=error)
        error = f"{type(error).__name__}: {error}"
    else:
        log.error("request %s: %s failed: %s", job.id, stage, error)
    message = RowFailure(f"request {job.id}: {stage} failed: {error}")
    message.client, message.param = client, getattr(job.grammar, "param", None)
    return message
