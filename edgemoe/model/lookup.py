"""Prompt lookup: speculative decoding whose draft is no model at all.

Code and edits repeat themselves: the tokens that followed the latest earlier occurrence
of the text's last few tokens (an n-gram of the prompt or of what was generated) are a
good guess of what comes next (llama.cpp's `lookup`, vLLM's n-gram speculator). The
guess costs nothing and reads nothing from disk; one forward call of the target over
the window (its last token and the guess) reads each expert the window routes to once,
and keeps the tokens the target itself chooses: mlx-lm's accept rule, each position
sampled by the target's sampler and the guess kept while they agree, so greedy output
is exactly greedy decode's.

Unlike a draft model in mlx-lm's loop, which drafts a fixed number of tokens, lookup
drafts only what it found: with no match the step is a plain decode step, and no
expert is read for a guess.
"""

import time
from typing import Generator, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.generate import GenerationResponse
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

# A guess comes from a match of 3 tokens: shorter matches guess worse, and where reads
# dominate each rejected guess costs the experts it routed to (on the bundled model at a
# 10% budget under a 20 MB/s read cap, 1-token matches read 1.39x the bytes per token of
# plain decode and ran at 0.72x; 3-token matches read 1.00x and ran at 1.00x)
MIN_NGRAM = MAX_NGRAM = 3


class PromptLookup:
    """The draft: `num_draft_tokens` at most, from n-grams of `min_ngram` to `max_ngram`
    tokens."""

    def __init__(self, num_draft_tokens: int = 3, max_ngram: int = MAX_NGRAM,
                 min_ngram: int = MIN_NGRAM):
        self.num_draft_tokens, self.max_ngram, self.min_ngram = \
            num_draft_tokens, max_ngram, min_ngram

    def draft(self, tokens: List[int], limit: int) -> List[int]:
        """The tokens after the latest earlier occurrence of the longest suffix of
        `tokens` that occurred before (at most `limit` of them); [] when none did."""
        limit = min(limit, self.num_draft_tokens)
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start:start + n] == suffix:
                    return tokens[start + n:start + n + limit]
        return []


def lookup_generate_step(prompt: mx.array, model, lookup: PromptLookup, *,
                         max_tokens: int = 256, sampler=None, logits_processors=None,
                         prompt_cache=None, prefill_step_size: int = 2048
                         ) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """(token, logprobs, from_draft), as mlx-lm's `speculative_generate_step` yields."""
    cache = prompt_cache if prompt_cache is not None else make_prompt_cache(model)
    if not can_trim_prompt_cache(cache):
        raise ValueError("prompt lookup needs a KV cache it can trim (not a rotating or "
                         "recurrent one)")
    sampler = sampler or (lambda logprobs: mx.argmax(logprobs, axis=-1))
    history, fed = prompt.tolist(), 0  # (a cached prefix is not looked up in)
    while len(history) - fed > 1:  # prefill all but the last token
        n = min(prefill_step_size, len(history) - 1 - fed)
        model(mx.array(history[fed:fed + n])[None], cache=cache)
        mx.eval([c.state for c in cache])
        fed += n
    produced = 0
    while produced < max_tokens:
        guess = lookup.draft(history, max_tokens - produced - 1)
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
        history += tokens
        for i, token in enumerate(tokens):
            produced += 1
            yield token, logprobs[i], i < len(tokens) - 1
            if produced == max_tokens:
                return


def stream_lookup(model, tokenizer, prompt: mx.array, max_tokens: int,
                  lookup: PromptLookup, **kwargs):
    """mlx-lm's `stream_generate` responses for `lookup_generate_step`'s tokens."""
    kwargs = {k: v for k, v in kwargs.items() if k in (
        "sampler", "logits_processors", "prompt_cache", "prefill_step_size")}
    detokenizer = tokenizer.detokenizer
    tic = time.perf_counter()
    prompt_tps, token, logprobs, from_draft, n = 0.0, None, None, False, -1
    for n, (token, logprobs, from_draft) in enumerate(lookup_generate_step(
            prompt, model, lookup, max_tokens=max_tokens, **kwargs)):
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
