"""Drafts for speculative decoding in our own loops: `draft_generate_step` here (what
`edgemoe.stream_generate` runs for these drafts) and the server's engine.

A draft proposes the next few tokens of a sequence; the streamed target verifies them in
one forward call over the window (its last token and the guess), which reads each expert
the window routes to once, and keeps the tokens it would have chosen itself. Two drafts:

- `PromptLookup` (edgemoe.mlx_backend.lookup): n-gram matches in the text so far; no model.
- `DraftModel`: a small resident mlx-lm model with the target's tokenizer, drafting
  greedily. Each sequence keeps its own draft KV cache, caught up before each draft with
  the tokens it has not seen (those the target decoded in a batch, without drafting).

`DraftLength` picks how many tokens to draft from what the windows so far measured.
(A plain mlx-lm model given as the draft runs in mlx-lm's own loop, as mlx-lm runs it.)
"""

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Dict, Generator, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.generate import GenerationResponse
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache


def prefill(model, cache, tokens: List[int], fed: int, step: int) -> int:
    """Run `tokens[fed:-1]` (all but the last, which the next call feeds) through `model`
    into `cache`, in chunks of `step`; how many tokens the cache then holds."""
    while len(tokens) - 1 > fed:
        n = min(step, len(tokens) - 1 - fed)
        model(mx.array(tokens[fed:fed + n])[None], cache=cache)
        mx.eval([c.state for c in cache])
        fed += n
    return fed


class DraftModel:
    """Greedy drafts from a resident mlx-lm model, one KV cache per sequence."""

    def __init__(self, model, num_draft_tokens: int = 3, prefill_step_size: int = 2048):
        self.model, self.num_draft_tokens = model, num_draft_tokens
        self.prefill_step_size = prefill_step_size
        self.length = DraftLength(num_draft_tokens)
        if not can_trim_prompt_cache(make_prompt_cache(model)):
            raise ValueError("the draft model's KV cache cannot be trimmed (a rotating or "
                             "recurrent cache): it cannot draft")

    def for_sequence(self) -> "SequenceDraft":
        return SequenceDraft(self)


class SequenceDraft:
    """A draft model's drafts for one sequence: its cache, and how many of the
    sequence's tokens it holds."""

    def __init__(self, source: DraftModel):
        self.source, self.cache, self.fed = source, make_prompt_cache(source.model), 0

    def catch_up(self, history: List[int]):
        """Feed the draft all but the last of `history` that it has not seen."""
        self.fed = prefill(self.source.model, self.cache, history, self.fed,
                           self.source.prefill_step_size)

    def draft(self, history: List[int], limit: int) -> List[int]:
        """Up to `limit` greedy tokens after `history` (the caller's length: DraftLength's
        choice, at most num_draft_tokens, or a request's own)."""
        model = self.source.model
        if limit <= 0:
            return []
        self.catch_up(history)
        token, out = history[-1], []
        for _ in range(limit):
            logits = model(mx.array([[token]]), cache=self.cache)[0, -1]
            token = int(mx.argmax(logits).item())
            out.append(token)
        self.fed += limit  # history[-1] and all drafts but the last went in
        return out

    def settle(self, valid: int):
        """The sequence's first `valid` tokens are what the cache holds that stays (the
        drafts the target rejected go)."""
        if self.fed > valid:
            trim_prompt_cache(self.cache, self.fed - valid)
            self.fed = valid


RECENT = 8  # windows of each length the choice looks at
PROBE_EVERY = 8  # windows


@dataclass
class DraftLength:
    """How many tokens to draft: the length that has given the most tokens per second.

    Per length, the tokens and seconds of its last RECENT windows; the seconds include
    the window's reads, so where reads dominate, long windows, which route to more
    experts, count as dear, and where compute dominates, so do the draft's own steps.
    Each length is tried once (the most first); then windows go to the best measured,
    and every PROBE_EVERY-th to each length in turn, so that every figure follows the
    cache, the text and the disk as they change. One DraftLength serves every sequence
    of a draft: the cost of a window is the model's, the disk's and the budget's.
    """

    most: int
    recent: Dict[int, deque] = field(default_factory=dict)  # drafts -> (tokens, seconds)
    windows: int = 0

    def choose(self) -> int:
        if self.most <= 0:
            return 0
        untried = [k for k in range(self.most, -1, -1) if k not in self.recent]
        if untried:
            return untried[0]
        if self.windows % PROBE_EVERY == PROBE_EVERY - 1:
            return self.windows // PROBE_EVERY % (self.most + 1)
        return max(self.recent, key=lambda k: (self.rate(k), -k))

    def rate(self, k: int) -> float:
        """Tokens per second of the recent windows drafted with length k."""
        windows = self.recent[k]
        return sum(t for t, _ in windows) / max(sum(s for _, s in windows), 1e-9)

    def record(self, chosen: int, produced: int, seconds: float):
        """A window drafted with `chosen` as its length (a lookup may find fewer) produced
        `produced` tokens in `seconds`."""
        self.recent.setdefault(chosen, deque(maxlen=RECENT)).append((produced, seconds))
        self.windows += 1


def draft_generate_step(prompt: mx.array, model, draft, *, max_tokens: int = 256,
                        sampler=None, logits_processors=None, prompt_cache=None,
                        prefill_step_size: int = 2048, adaptive: bool = True
                        ) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """(token, logprobs, from_draft), as mlx-lm's `speculative_generate_step` yields, for a
    `draft` with `for_sequence()` (PromptLookup, DraftModel). `adaptive`: the draft length
    follows the draft's DraftLength, at most its `num_draft_tokens`; else always that many."""
    cache = prompt_cache if prompt_cache is not None else make_prompt_cache(model)
    if not can_trim_prompt_cache(cache):
        raise ValueError("speculative decoding needs a KV cache it can trim (not a "
                         "rotating or recurrent one)")
    sampler = sampler or (lambda logprobs: mx.argmax(logprobs, axis=-1))
    sequence, length = draft.for_sequence(), draft.length
    history = prompt.tolist()  # (a cached prefix is not looked up in)
    prefill(model, cache, history, 0, prefill_step_size)
    sequence.catch_up(history)  # the draft's prefill, with the target's
    produced = 0
    while produced < max_tokens:
        tic = time.perf_counter()
        arm = length.choose() if adaptive else draft.num_draft_tokens
        guess = sequence.draft(history, min(arm, max_tokens - produced - 1))
        window = history[-1:] + guess
        logits = model(mx.array(window)[None], cache=cache)[0]
        tokens, logprobs = [], []
        for i in range(len(window)):  # each position as the target alone would sample it
            row = logits[i:i + 1]
            for process in logits_processors or ():
                row = process(mx.array(history + tokens), row)
            scores = row - mx.logsumexp(row, axis=-1, keepdims=True)
            tokens.append(int(sampler(scores).item()))
            logprobs.append(scores[0])
            if i >= len(guess) or tokens[-1] != guess[i]:
                break
        trim_prompt_cache(cache, len(window) - len(tokens))  # the guesses not kept
        sequence.settle(len(history) + len(tokens) - 1)
        if adaptive:
            length.record(arm, len(tokens), time.perf_counter() - tic)
        history += tokens
        for i, token in enumerate(tokens):
            produced += 1
            yield token, logprobs[i], i < len(tokens) - 1
            if produced == max_tokens:
                return


def stream_drafted(model, tokenizer, prompt: mx.array, max_tokens: int, draft, **kwargs):
    """mlx-lm's `stream_generate` responses for `draft_generate_step`'s tokens."""
    kwargs = {k: v for k, v in kwargs.items() if k in (
        "sampler", "logits_processors", "prompt_cache", "prefill_step_size", "adaptive")}
    detokenizer = tokenizer.detokenizer
    tic = time.perf_counter()
    prompt_tps, token, logprobs, from_draft, n = 0.0, None, None, False, -1
    for n, (token, logprobs, from_draft) in enumerate(draft_generate_step(
            prompt, model, draft, max_tokens=max_tokens, **kwargs)):
        if n == 0:
            prompt_tps = prompt.size / (time.perf_counter() - tic)
            tic = time.perf_counter()
        if token in tokenizer.eos_token_ids:
            break
        detokenizer.add_token(token)
        if n + 1 == max_tokens:
            break
        yield _response(detokenizer.last_segment, token, logprobs, from_draft, prompt,
                        prompt_tps, n, tic, None)
    detokenizer.finalize()
    yield _response(detokenizer.last_segment, token, logprobs, from_draft, prompt,
                    prompt_tps, n, tic,
                    "stop" if token in tokenizer.eos_token_ids else "length")


def _response(text, token, logprobs, from_draft, prompt, prompt_tps, n, tic,
              finish: Optional[str]) -> GenerationResponse:
    return GenerationResponse(
        text=text, token=token, logprobs=logprobs, from_draft=from_draft,
        prompt_tokens=prompt.size, prompt_tps=prompt_tps, generation_tokens=n + 1,
        generation_tps=(n + 1) / max(time.perf_counter() - tic, 1e-9),
        peak_memory=mx.get_peak_memory() / 1e9, finish_reason=finish)
