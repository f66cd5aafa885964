"""Speculation: a request decoded alone drafts a few tokens and verifies them in one call.

With a draft (`--draft-model` or `--prompt-lookup`), a request decoded alone speculates:
each step drafts a few tokens and verifies them in one forward call of the target over
the window, keeping the tokens the target itself chooses at each position (mlx-lm's
accept rule, each position sampled with the request's own sampler and key, so greedy and
seeded output are the request's without a draft). A batch of two or more decodes one
token per row, as without a draft: speculation pays where a step is dear, and a batch
already shares each step's reads. The draft length adapts per request
(edgemoe.mlx_backend.drafts.DraftLength).
"""

import time

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from . import sampling
from .job import Job
from .outcomes import advance, fail_row


def speculates(engine) -> bool:
    """Whether the engine's next step is a speculative one: a draft, one row, one host."""
    return (engine.draft is not None and len(engine.active) == 1 and engine.share is None
            and can_trim_prompt_cache(engine.batch_cache))


def speculative_step(engine, job: Job):
    """Draft, verify the window in one call, keep what the target chooses."""
    history, had, metrics = job.prompt + job.tokens, len(job.tokens), engine.metrics
    if job.draft is None:
        job.draft = engine.draft.for_sequence()
    job.draft.catch_up(history)  # (tokens it decoded in a batch: not the window's time)
    tic, before = time.perf_counter(), metrics.store_stats()
    fixed = job.num_draft_tokens is not None  # the request's own (mlx_lm.server's field)
    arm = job.num_draft_tokens if fixed else engine.draft.length.choose()
    guess = job.draft.draft(history, min(arm, job.max_tokens - had - 1))
    window = [job.next_input] + guess
    logits = engine.model(mx.array([window]), cache=engine.batch_cache)[0]
    mx.eval(logits, [c.state for c in engine.batch_cache])
    kept, done, failed = 0, False, None
    for i in range(len(window)):  # each position as the target alone would choose it
        try:
            token, chosen, top = sampling.choose(job, logits[i:i + 1])
            if job.first_token_at is None:
                job.first_token_at = time.perf_counter()
            done = advance(engine, job, token, chosen, top)
        except Exception as e:
            failed = sampling.row_failed(job, "advancing", e) \
                if not isinstance(e, sampling.RowError) else str(e)
            break
        if done or i == len(guess) or token != guess[i]:
            break
        kept += 1
    metrics.count(metrics.decode, before)
    metrics.count_step(1, len(job.tokens) - had, windows=1, drafted=len(guess), accepted=kept)
    if failed is not None or done:
        if failed is not None:
            fail_row(engine, job, failed)
        engine.keep_rows([])
        return
    emitted = len(job.tokens) - had
    trim_prompt_cache(engine.batch_cache, len(window) - emitted)  # the guesses not kept
    job.draft.settle(len(history) + kept)
    if not fixed:
        engine.draft.length.record(arm, emitted, time.perf_counter() - tic)
