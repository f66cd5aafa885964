"""A request as the engine sees it: tokens in, events out, and its text held back from
a stop string."""

import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple


@dataclass(eq=False)  # jobs are compared by identity
class Job:
    """One request as the engine sees it: tokens in, events out."""

    id: str
    prompt: List[int]
    max_tokens: int
    emit: Callable[[dict], None]  # called on the engine thread; must not block
    sampling: Optional[dict] = None  # make_request_sampler's arguments; None: greedy
    stop: List[str] = field(default_factory=list)
    want_logprobs: bool = False
    top_logprobs: int = 0  # the most likely tokens reported beside each chosen one
    processors: list = field(default_factory=list)  # mlx-lm logits processors (penalties,
    #                                                  logit_bias): f(tokens, logits) -> logits
    grammar: object = None  # a constrain.Grammar the tokens must follow; None: free
    prompt_logprobs: bool = False  # the logprob of each prompt token (completions echo)
    use_prompt_cache: bool = True
    cache_scope: str = ""  # whose prompt-cache entries it may use (serving.cache_scope)
    received: float = field(default_factory=time.perf_counter)
    cancelled: bool = False  # set by the HTTP side; the engine drops the job between steps
    # engine-side state (MLX arrays are made on the engine thread only)
    sampler: Optional[Callable] = None
    cache: Optional[list] = None
    prefilled: int = 0
    next_input: int = -1
    tokens: List[int] = field(default_factory=list)
    detokenizer: object = None
    text: str = ""
    sent: int = 0  # characters of `text` already emitted
    first_token_at: Optional[float] = None
    stop_hit: Optional[str] = None  # the stop string that ended the job
    cached_tokens: int = 0  # prompt tokens whose KV cache came from the prompt cache
    prompt_scores: List[Optional[float]] = field(default_factory=list)
    prompt_top: list = field(default_factory=list)  # each prompt token's top_logprobs
    draft: object = None  # the draft's state for this sequence (its for_sequence())
    num_draft_tokens: Optional[int] = None  # a window's drafts, fixed; None: DraftLength's

    def take(self, token: int, eos) -> Tuple[str, Optional[str]]:
        """Add the next token: (the text it releases, why the job ends or None)."""
        self.tokens.append(token)
        finish = None
        if token in eos:
            finish = "stop"
        else:
            self.detokenizer.add_token(token)
            self.text += self.detokenizer.last_segment
            self.next_input = token
            if self.grammar is not None and self.grammar.accept(token):
                finish = "stop"  # the grammar is complete: nothing more may follow
        if len(self.tokens) >= self.max_tokens:
            finish = finish or "length"
        if finish is not None:  # flush what the detokenizer still holds
            self.detokenizer.finalize()
            self.text += self.detokenizer.last_segment
        text, hit = self.releasable(final=finish is not None)
        return text, "stop" if hit else finish

    def releasable(self, final: bool):
        """Text safe to send now: up to a stop string, and never a stop string's start."""
        found = [(at, s) for s in self.stop
                 if (at := self.text.find(s, max(0, self.sent - len(s) + 1))) >= 0]
        if found:
            at, self.stop_hit = min(found)
            text, self.sent = self.text[self.sent:at], at
            return text, True
        end = len(self.text)
        if not final:
            for s in self.stop:  # hold back a suffix that may grow into a stop string
                for n in range(min(len(s) - 1, end - self.sent), 0, -1):
                    if self.text.endswith(s[:n]):
                        end = min(end, len(self.text) - n)
                        break
        text, self.sent = self.text[self.sent:end], end
        return text, False
