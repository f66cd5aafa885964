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
expert is read for a guess. The loop that verifies its drafts is edgemoe.mlx_backend.drafts's.
"""

from typing import List

from .drafts import DraftLength

# A guess comes from a match of 3 tokens: shorter matches guess worse, and where reads
# dominate each rejected guess costs the experts it routed to (on the bundled model at a
# 10% budget under a 20 MB/s read cap, 1-token matches read 1.39x the bytes per token of
# plain decode and ran at 0.72x; 3-token matches read 1.00x and ran at 1.00x)
MIN_NGRAM = MAX_NGRAM = 3


class PromptLookup:
    """The draft: tokens that followed an earlier n-gram of `min_ngram` to `max_ngram`
    tokens; its DraftLength chooses at most `num_draft_tokens` of them per window."""

    def __init__(self, num_draft_tokens: int = 3, max_ngram: int = MAX_NGRAM,
                 min_ngram: int = MIN_NGRAM):
        self.num_draft_tokens, self.max_ngram, self.min_ngram = \
            num_draft_tokens, max_ngram, min_ngram
        self.length = DraftLength(num_draft_tokens)  # shared by its sequences

    def for_sequence(self) -> "PromptLookup":
        return self  # it keeps nothing per sequence

    def catch_up(self, history: List[int]):
        pass

    def settle(self, valid: int):
        pass

    def draft(self, tokens: List[int], limit: int) -> List[int]:
        """The tokens after the latest earlier occurrence of the longest suffix of
        `tokens` that occurred before (at most `limit` of them); [] when none did."""
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start:start + n] == suffix:
                    return tokens[start + n:start + n + limit]
        return []
