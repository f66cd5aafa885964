"""Prefilled KV caches kept for later requests that start with the same tokens.

mlx-lm's LRUPromptCache holds them (at most `max_entries`, and `max_bytes`); this adds
the rule that keeps a request's output what it is alone: only prefills are kept, and at
least two tokens are left to prefill (see `fetch`)."""

from typing import List

from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache


class PromptCache:
    def __init__(self, max_entries: int, max_bytes: int):
        self.lru = LRUPromptCache(max_entries, max_bytes)

    def fetch(self, tokens: List[int]):
        """(the KV cache of the longest cached prefix of `tokens`, the tokens after it),
        or (None, tokens). At least two tokens are left to prefill: some families'
        attention computes a one-token call differently from a longer one (deepseek_v3's
        MLA, by 1e-6), and a request must give what it gives alone, where its prefill
        never runs one token after a long chunk. Only prefills are cached, for the same
        reason: a reply's KV, made one token at a time, would differ from the prefill of
        the same tokens in the next turn sent alone."""
        if len(tokens) < 3:
            return None, tokens
        cache, rest = self.lru.fetch_nearest_cache("model", tokens)
        if cache is not None and len(rest) < 2:
            if not can_trim_prompt_cache(cache) or len(tokens) - len(rest) <= 2:
                return None, tokens
            trim_prompt_cache(cache, 2 - len(rest))
            rest = tokens[len(tokens) - 2:]
        return cache, rest

    def insert(self, tokens: List[int], cache: list):
        """Keep `cache` (of `tokens`, all prefilled) for later requests that start with
        them."""
        self.lru.insert_cache("model", list(tokens), cache, cache_type="user")

    def __len__(self) -> int:
        return len(self.lru)

    @property
    def nbytes(self) -> int:
        return self.lru.nbytes
