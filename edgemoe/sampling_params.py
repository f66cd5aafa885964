"""One reading of the sampling parameters, shared by every way in (the OpenAI, Responses,
Anthropic and Ollama APIs and `generate --temp/--top-p`): each value either gives the
result its limit implies or is refused naming its field, never random tokens.

Two limits are not what the arithmetic would give in float32, so they are read here:
- a temperature whose 1/temp overflows float32 (below ~2.9e-39) would scale the best
  token's logprob 0 by infinity (NaN) and every other one to -inf; its limit is greedy;
- a `top_p` of 0 (or one so small that top_p times the mass underflows float32) would
  keep no token, and mlx-lm's chain then skips top-p and samples the whole distribution;
  its limit, like 1e-9's, is the most likely token: greedy.
Sampling itself scales logprobs shifted by their maximum (`scaled`), so that no finite
temperature turns every token into -inf (then categorical draws uniformly).
"""

from typing import Optional

import mlx.core as mx
import numpy as np

FLOAT32_MAX = float(np.finfo(np.float32).max)
GREEDY_BELOW = 1 / FLOAT32_MAX  # temperatures under this are greedy (1/temp overflows)
TOP_P_GREEDY_BELOW = float(np.finfo(np.float32).tiny)  # top_p * mass underflows: greedy
# Sampling ranges inside which a row's logits stay finite in float32: past them every
# token is equally likely (temperature) or a penalty divides by nearly zero, and the
# row's logits become NaN (1/1e308 is 0 in float32, and -inf * 0 is NaN)
MAX_TEMPERATURE = 1000.0
PENALTY_RANGE = {"repetition_penalty": (1e-3, 1e3), "presence_penalty": (-1e3, 1e3),
                 "frequency_penalty": (-1e3, 1e3)}


def check_sampling(temperature: float = 0.0, penalties: Optional[dict] = None):
    """None, or (the field, the message) of the first sampling value outside the ranges
    above (a repetition penalty of 0 or 1 is off)."""
    if not (isinstance(temperature, (int, float)) and 0 <= temperature <= MAX_TEMPERATURE):
        return "temperature", (f"must be within [0, {MAX_TEMPERATURE:g}] (higher makes "
                               f"every token equally likely), got {temperature}")
    for name, value in (penalties or {}).items():
        if name not in PENALTY_RANGE or value is None or \
                (name == "repetition_penalty" and value in (0, 1)):
            continue
        lo, hi = PENALTY_RANGE[name]
        if not (isinstance(value, (int, float)) and lo <= value <= hi):
            return name, f"must be within [{lo:g}, {hi:g}], got {value}"
    return None


def is_greedy(temperature: float, top_p: float = 1.0, top_k: int = 0) -> bool:
    """Whether these values' limit is the most likely token (see the module's note)."""
    return temperature < GREEDY_BELOW or top_p < TOP_P_GREEDY_BELOW or top_k == 1


def sampler_args(temperature: float, top_p: float = 1.0, min_p: float = 0.0,
                 top_k: int = 0, seed: Optional[int] = None) -> Optional[dict]:
    """make_request_sampler's arguments for checked values, or None: greedy."""
    if is_greedy(temperature, top_p, top_k):
        return None
    return dict(temp=temperature, top_p=top_p, min_p=min_p, top_k=top_k, seed=seed)


def scaled(logprobs: mx.array, temp: float) -> mx.array:
    """`logprobs` / `temp` as categorical takes them: shifted so the best is 0 (a
    softmax is unchanged by a shift), so that a tiny temperature leaves the best
    token finite and every other one far below it, never all at -inf."""
    return (logprobs - mx.max(logprobs, axis=-1, keepdims=True)) * (1 / temp)


def shifted(sampler):
    """mlx-lm's sampler (make_sampler) on logprobs shifted so the best is 0: its top-p,
    min-p and top-k are unchanged by the shift, and its categorical then cannot see
    every token at -inf (see `scaled`)."""
    def sample(logprobs: mx.array) -> mx.array:
        return sampler(logprobs - mx.max(logprobs, axis=-1, keepdims=True))

    return sample


def cli_sampler(temp: float, top_p: float = 1.0, min_p: float = 0.0, top_k: int = 0):
    """`generate`'s sampler: mlx-lm's chain (drawing from MLX's global key, which
    --seed and a group's common seed set), greedy where the values' limit is."""
    from mlx_lm.sample_utils import make_sampler

    if is_greedy(temp, top_p, top_k):
        return make_sampler(0.0)
    return shifted(make_sampler(temp, top_p, min_p, top_k=top_k))
