"""Generation with mlx-lm's loop, plus expert-store statistics."""

from dataclasses import dataclass
from typing import Generator, Optional

from mlx_lm.generate import GenerationResponse as MlxLmResponse
from mlx_lm.generate import stream_generate as mlx_lm_stream_generate

from ..streaming.stats import ExpertStats
from ..streaming.telemetry import peak_rss_bytes


@dataclass
class GenerationResponse(MlxLmResponse):
    """mlx-lm's response, plus the expert store's counters for prefill and decode."""

    prompt_experts: Optional[ExpertStats] = None
    decode_experts: Optional[ExpertStats] = None
    peak_rss: float = 0.0  # GB

    @property
    def blocked_ms_per_token(self) -> float:
        if not self.decode_experts or not self.generation_tokens:
            return 0.0
        return 1000 * self.decode_experts.blocked_s / self.generation_tokens


def stream_generate(model, tokenizer, prompt, max_tokens: int = 256,
                    draft_model=None, **kwargs) -> Generator[GenerationResponse, None, None]:
    """`mlx_lm.stream_generate`, with expert statistics on every response."""
    store = getattr(model, "expert_store", None)
    snapshot = store.snapshot if store else ExpertStats
    start = snapshot()
    after_prompt = None
    for r in mlx_lm_stream_generate(model, tokenizer, prompt, max_tokens,
                                    draft_model, **kwargs):
        if after_prompt is None:
            after_prompt = snapshot()
        yield GenerationResponse(
            **vars(r),
            prompt_experts=after_prompt - start,
            decode_experts=snapshot() - after_prompt,
            peak_rss=peak_rss_bytes() / 1e9,
        )


def generate(model, tokenizer, prompt, verbose: bool = False, **kwargs) -> str:
    """`mlx_lm.generate`: the whole completion as a string."""
    text, response = "", None
    for response in stream_generate(model, tokenizer, prompt, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose:
        print()
        if response is not None:
            print_stats(response)
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
              f"read {e.read_gbps:.2f} GB/s while reading")
        if e.predicted:
            print(f"Prefetch: precision {e.precision:.1%}, recall {e.recall:.1%}, "
                  f"{e.prefetches} fills ahead, {e.late_fills} arrived late, "
                  f"{e.on_demand} loaded on demand")
