"""Prefilled KV caches kept for later requests that start with the same tokens.

mlx-lm's LRUPromptCache holds them in memory (at most `max_entries`, and `max_bytes`);
with a folder (`--prompt-cache-dir`, edgemoe.serving.disk_cache) they are also kept on
disk, so they outlive the process and memory's few entries. Every entry belongs to a
scope (`--prompt-cache-scope`): a request finds only its own scope's prefixes, so
`cached_tokens` says nothing about other scopes' prompts. This adds the rule that keeps a
request's output what it is alone: only prefills are kept, and at least two tokens are
left to prefill (see `fetch`)."""

import logging
from typing import Callable, List, Optional

from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

from .disk_cache import DiskPromptCache

log = logging.getLogger("edgemoe.server")


class PromptCache:
    def __init__(self, max_entries: int, max_bytes: int,
                 open_disk: Optional[Callable[[], DiskPromptCache]] = None):
        """`open_disk()`: the DiskPromptCache, opened on first use (the model is loaded
        by then: its files are the cache's identity), or None: memory only."""
        self.lru = LRUPromptCache(max_entries, max_bytes)
        self.open_disk = open_disk
        self._disk: Optional[DiskPromptCache] = None

    @property
    def disk(self) -> Optional[DiskPromptCache]:
        if self._disk is None and self.open_disk is not None:
            self._disk = self.open_disk()
        return self._disk

    def fetch(self, tokens: List[int], scope: str = ""):
        """(the KV cache of the longest cached prefix of `tokens` in `scope`, the tokens
        after it), or (None, tokens). At least two tokens are left to prefill: some
        families' attention computes a one-token call differently from a longer one
        (deepseek_v3's MLA, by 1e-6), and a request must give what it gives alone, where
        its prefill never runs one token after a long chunk. Only prefills are cached, for
        the same reason: a reply's KV, made one token at a time, would differ from the
        prefill of the same tokens in the next turn sent alone."""
        if len(tokens) < 3:
            return None, tokens
        cache, rest = self.lru.fetch_nearest_cache(scope, tokens)
        if self.disk is not None:
            have = len(tokens) - len(rest) if cache is not None else 0
            found, length = self.disk.load(scope, tokens, better_than=have)
            if found is not None:
                cache, rest = found, tokens[length:]
        if cache is not None and len(rest) < 2:
            if not can_trim_prompt_cache(cache) or len(tokens) - len(rest) <= 2:
                return None, tokens
            trim_prompt_cache(cache, 2 - len(rest))
            rest = tokens[len(tokens) - 2:]
        return cache, rest

    def insert(self, tokens: List[int], cache: list, scope: str = ""):
        """Keep `cache` (of `tokens`, all prefilled) for later requests of `scope` that
        start with them; on disk too, where a write that fails is logged, not fatal."""
        self.lru.insert_cache(scope, list(tokens), cache, cache_type="user")
        if self.disk is not None:
            try:
                self.disk.save(scope, list(tokens), cache)
            except OSError as e:
                log.warning("prompt cache: could not write an entry to %s: %s",
                            self.disk.folder, e)

    def __len__(self) -> int:
        return len(self.lru)

    @property
    def nbytes(self) -> int:
        return self.lru.nbytes
