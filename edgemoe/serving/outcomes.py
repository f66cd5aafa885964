"""How a request ends on the engine thread: a token that may finish it, its finish, a row's
own failure, a batch's failure; and the health that the server's own failures make
(/health turns 503 once UNHEALTHY_AFTER requests in a row failed by them)."""

import logging
import time
from typing import List

from .job import Job
from .metrics import Finished, log_finished

log = logging.getLogger("edgemoe.server")

# requests failing in a row for the server's own reasons (a read error, a failed step;
# never a request's own fault), none finished since: the model cannot serve, and
# /health says so (a truncated pack once failed every request under a 200 /health)
UNHEALTHY_AFTER = 3


class Health:
    """Requests failed in a row by the server's own errors, and the last one's message."""

    def __init__(self):
        self.failing, self.last_failure = 0, ""

    def serving(self) -> bool:
        """False once UNHEALTHY_AFTER requests in a row failed; a finished one resets it."""
        return self.failing < UNHEALTHY_AFTER

    def failed(self, count: int, message: str):
        self.failing += count
        self.last_failure = message


def advance(engine, job: Job, token: int, logprob: float, top=None) -> bool:
    """Give `job` its next token; True when the job has finished."""
    text, finish = job.take(token, engine.eos)
    job.emit({"type": "token", "token": token, "logprob": logprob, "text": text,
              "top": top})
    if finish is not None:
        finish_job(engine, job, finish)
        return True
    return False


def finish_job(engine, job: Job, reason: str):
    engine.health.failing = 0
    now = time.perf_counter()
    done = Finished(now - job.received, (job.first_token_at or now) - job.received,
                    len(job.prompt), len(job.tokens))
    with engine.metrics.lock:
        engine.metrics.completed += 1
        engine.metrics.recent.append(done)
    job.emit({"type": "done", "finish_reason": reason, "prompt_tokens": len(job.prompt),
              "completion_tokens": len(job.tokens), "cached_tokens": job.cached_tokens,
              "prompt_logprobs": job.prompt_scores if job.prompt_logprobs else None,
              "prompt_top": job.prompt_top if job.prompt_logprobs else None})
    log_finished(job.id, reason, done, engine.snapshot())


def fail_row(engine, job: Job, message: str):
    """One row's own failure: its request ends with an error, the batch goes on (the
    caller drops the row). A client whose emit fails is only logged."""
    engine.metrics.add(failed=1)
    event = {"type": "error", "message": message}
    if getattr(message, "client", False):  # the request's own doing: a 400
        event.update(status=400, param=message.param)
    else:
        engine.health.failed(1, message)
    try:
        job.emit(event)
    except Exception:
        log.exception("request %s: its error could not be sent", job.id)


def fail_jobs(engine, jobs: List[Job], message: str):
    """`jobs` end with the server's own error; a batch one of them is in is dropped whole
    (its caches are suspect)."""
    for job in jobs:
        if job in engine.pending:
            engine.pending.remove(job)
    if any(job in engine.active for job in jobs):
        engine.active, engine.batch_cache, engine.batch_routing = [], None, None
    engine.metrics.add(failed=len(jobs))
    if jobs and not engine.stopping.is_set():
        engine.health.failed(len(jobs), message)
    for job in jobs:
        job.cache = None
        job.emit({"type": "error", "message": message})
