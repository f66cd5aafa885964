"""Generation with mlx-lm's loop, plus expert-store statistics."""

from dataclasses import dataclass
from typing import Generator, Optional

import mlx.core as mx
from mlx_lm.generate import GenerationResponse as MlxLmResponse
from mlx_lm.generate import stream_generate as mlx_lm_stream_generate

from ..streaming.stats import ExpertStats
from .drafts import DraftModel, stream_drafted
from .experts import streaming_of
from .lookup import PromptLookup
from ..streaming.telemetry import peak_rss_bytes


@dataclass
class GenerationResponse(MlxLmResponse):
    """mlx-lm's response, plus the expert store's counters for prefill and decode.

    The split is taken as the first decode forward call starts (mlx-lm computes a step
    ahead of the token it yields), so `prompt_experts` is the prompt alone and
    `decode_experts` covers `decode_forwards` forward calls."""

    prompt_experts: Optional[ExpertStats] = None
    decode_experts: Optional[ExpertStats] = None
    decode_forwards: int = 0
    peak_rss: float = 0.0  # GB

    @property
    def blocked_ms_per_token(self) -> float:
        """Milliseconds decode waited for expert reads, per decode forward call (one per
        generated token)."""
        if not self.decode_experts or not self.decode_forwards:
            return 0.0
        return 1000 * self.decode_experts.blocked_s / self.decode_forwards


class _Split:
    """Counts the tokens fed to the model and snapshots the store as the first forward
    call past the prompt begins."""

    def __init__(self, snapshot, prompt_tokens: int):
        self.snapshot, self.prompt_tokens = snapshot, prompt_tokens
        self.fed, self.forwards, self.at = 0, 0, None

    def __call__(self, inputs):
        if self.fed >= self.prompt_tokens:
            if self.at is None:
                self.at = self.snapshot()
            self.forwards += 1
        self.fed += inputs.shape[1] if inputs is not None and inputs.ndim > 1 else 1


def stream_generate(model, tokenizer, prompt, max_tokens: int = 256,
                    draft_model=None, **kwargs) -> Generator[GenerationResponse, None, None]:
    """`mlx_lm.stream_generate`, with expert statistics on every response."""
    streaming = streaming_of(model)
    snapshot = streaming.store.snapshot if streaming else ExpertStats
    if not isinstance(prompt, mx.array):  # as mlx_lm.stream_generate encodes it
        if isinstance(prompt, str):
            bos = getattr(tokenizer, "bos_token", None)
            prompt = tokenizer.encode(prompt, add_special_tokens=bos is None
                                      or not prompt.startswith(bos))
        prompt = mx.array(prompt)
    split = _Split(snapshot, len(prompt))
    hooked = streaming is not None and draft_model is None
    # (speculative steps feed several tokens: decode_forwards counts tokens there)
    if hooked:
        model.forward_hook = split
    start = snapshot()
    if isinstance(draft_model, (PromptLookup, DraftModel)):  # drafts of any length
        responses = stream_drafted(model, tokenizer, prompt, max_tokens, draft_model,
                                   **kwargs)
    else:
        kwargs.pop("prompt_lookup", None)
        responses = mlx_lm_stream_generate(model, tokenizer, prompt, max_tokens,
                                           draft_model, **kwargs)
    try:
        for r in responses:
            if split.at is None:  # no hook (or a prompt cache): the first response
                split.at = snapshot()
            yield GenerationResponse(
                **vars(r),
                prompt_experts=split.at - start,
                decode_experts=snapshot() - split.at,
                decode_forwards=split.forwards if hooked else r.generation_tokens,
                peak_rss=peak_rss_bytes() / 1e9,
            )
    finally:
        if hooked:
            model.forward_hook = None


def generate(model, tokenizer, prompt, verbose: bool = False, **kwargs) -> str:
    """`mlx_lm.generate`: the whole completion as a string."""
    text, response, drafted = "", None, 0
    for response in stream_generate(model, tokenizer, prompt, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
        drafted += bool(response.from_draft)
    if verbose:
        print()
        if response is not None:
            print_stats(response)
            if kwargs.get("draft_model") is not None:
                print(f"Draft: {drafted} of {response.generation_tokens} tokens drafted "
                      f"and kept")
    return text


def print_stats(r: GenerationResponse):
    e = r.decode_experts
    print("=" * 10)
    print(f"Prompt: {r.prompt_tokens} tokens, {r.prompt_tps:.3f} tokens-per-sec")
    print(f"Generation: {r.generation_tokens} tokens, {r.generation_tps:.3f} tokens-per-sec")
    print(f"Peak memory: {r.peak_memory:.3f} GB (MLX), peak RSS: {r.peak_rss:.3f} GB")
    if e is not None:
        p = r.prompt_experts
        print(f"Experts: read {(p.bytes_read + e.bytes_read) / 1e6:.2f} MB "
              f"(prompt {p.bytes_read / 1e6:.2f} MB, decode {e.bytes_read / 1e6:.2f} MB), "
              f"decode hit rate {e.hit_rate:.1%}, "
              f"blocked {r.blocked_ms_per_token:.2f} ms/token, "
              f"read {e.read_gbps:.2f} GB/s while reading "
              f"({1000 * (p.verify_s + e.verify_s):.1f} ms checking and copying)")
        if e.predicted:
            print(f"Prefetch: precision {e.precision:.1%}, recall {e.recall:.1%}, "
                  f"{e.prefetches} fills ahead, {e.late_fills} arrived late, "
                  f"{e.on_demand} loaded on demand")
