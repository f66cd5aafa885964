"""Issue 41: no request can hurt another.

The engine's per-row boundary: a fault injected into each per-row stage of one request
(its logits processors, grammar, sampler, top logprobs, detokenizer, stop strings, its
client's emit) ends that request alone, with an error naming only it, while three
requests decoded in the same batch give exactly the text they give alone.
"""

import threading
import time

import mlx.core as mx
import pytest

from edgemoe.serving import engine as engine_mod
from edgemoe.serving.engine import Engine, Job

PROMPTS = ["The quick brown fox", "import os\nimport sys\n", "Once upon a time there"]
GOOD_TOKENS = 16


@pytest.fixture(scope="module")
def engine():
    from edgemoe.model.loader import load

    e = Engine(lambda: load(None, return_config=True, expert_budget="100%"),
               max_batch=8, prompt_cache_size=0)
    e.start(timeout=120)
    yield e
    e.stop()


def run(engine, jobs, timeout=60.0):
    """Submit `jobs` together; {job id: (token texts, last event)} once all have ended."""
    ended = {j.id: threading.Event() for j in jobs}
    seen = {j.id: [] for j in jobs}
    for job in jobs:
        inner = job.emit

        def emit(event, job=job, inner=inner):
            seen[job.id].append(event)
            if event["type"] != "token":
                ended[job.id].set()
            inner(event)  # the poison's own emit may raise after recording

        job.emit = emit
    for job in jobs:
        assert engine.submit(job)
    for job in jobs:
        assert ended[job.id].wait(timeout), f"{job.id} did not end"
    return {i: ("".join(e["text"] for e in ev if e["type"] == "token"), ev[-1])
            for i, ev in seen.items()}


def good_jobs(engine, tag):
    return [Job(id=f"good-{tag}-{n}", prompt=engine.tokenizer.encode(p),
                max_tokens=GOOD_TOKENS, emit=lambda e: None)
            for n, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def solo(engine):
    """Each good prompt's greedy text decoded alone."""
    texts = []
    for job in good_jobs(engine, "solo"):
        (text, last), = run(engine, [job]).values()
        assert last["type"] == "done", last
        texts.append(text)
    return texts


class Grammar:
    """A grammar whose mask or accept fails, with a secret in its message."""

    def __init__(self, fail: str):
        self.fail = fail

    def mask(self, logits):
        if self.fail == "mask":
            raise ValueError("SECRET-GRAMMAR of the poison request")
        return logits

    def accept(self, token):
        if self.fail == "accept":
            raise ValueError(f"token {token} does not follow SECRET-GRAMMAR")
        return False


class Detokenizer:
    def add_token(self, token):
        raise RuntimeError("SECRET-DETOKENIZER broke")


def _raise(*args):
    raise RuntimeError("SECRET-PROCESSOR broke")


def _raising_emit(event):
    if event["type"] == "token":
        raise ConnectionError("SECRET-CLIENT went away badly")


POISONS = {  # stage: Job fields of the poison request
    "processor raises": dict(processors=[_raise]),
    "processor reshapes": dict(processors=[lambda tokens, logits: logits[:, :5]]),
    "processor NaN": dict(processors=[lambda tokens, logits: logits * mx.nan]),
    "processor all -inf": dict(processors=[lambda tokens, logits: logits - mx.inf]),
    "grammar mask": dict(grammar=Grammar("mask")),
    "grammar accept": dict(grammar=Grammar("accept")),
    "sampler raises": dict(sampling=dict(temp=0.7, seed=41001)),
    "sampler out of range": dict(sampling=dict(temp=0.7, seed=41002)),
    "top logprobs": dict(top_logprobs=7),
    "detokenizer": dict(),  # its detokenizer is replaced below
    "stop check": dict(stop=[None]),
    "client emit": dict(emit=_raising_emit),
    "temperature 1e308": dict(sampling=dict(temp=1e308)),
}


@pytest.mark.parametrize("stage", list(POISONS))
def test_a_fault_in_one_rows_stage_ends_that_row_alone(engine, solo, stage, monkeypatch):
    make_sampler = engine_mod.make_request_sampler

    def sampler(**kw):
        if kw.get("seed") == 41001:
            return lambda logprobs: _raise()
        if kw.get("seed") == 41002:
            return lambda logprobs: mx.array([10**7])
        return make_sampler(**kw)

    top = engine_mod._top

    def top_of(logprobs, n):
        return _raise() if n == 7 else top(logprobs, n)

    start = engine._start_prefill

    def start_prefill(job):
        start(job)
        if job.id.startswith("poison-detokenizer"):
            job.detokenizer = Detokenizer()

    monkeypatch.setattr(engine_mod, "make_request_sampler", sampler)
    monkeypatch.setattr(engine_mod, "_top", top_of)
    monkeypatch.setattr(engine, "_start_prefill", start_prefill)
    fields = {"emit": lambda e: None, **POISONS[stage]}
    poison = Job(id=f"poison-{stage.replace(' ', '-')}",
                 prompt=engine.tokenizer.encode("Poison"), max_tokens=GOOD_TOKENS, **fields)
    goods = good_jobs(engine, stage.replace(" ", "-"))
    out = run(engine, goods + [poison])  # the poison joins the goods' batch last
    for job, want in zip(goods, solo):
        text, last = out[job.id]
        assert last["type"] == "done", (stage, last)
        assert text == want, stage
    text, last = out[poison.id]
    assert last["type"] == "error", (stage, last)
    assert last["message"].startswith(f"request {poison.id}: "), last["message"]
    assert "good-" not in last["message"]
