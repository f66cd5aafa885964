"""What the CUDA backend needs to know per MoE family to run transformers' own class on a pack.

A pack's resident weights carry mlx-lm's names, after mlx-lm's `sanitize()`
(mlx_lm/models/<family>.py) mapped the Hugging Face checkpoint to them; `FAMILIES` undoes,
per family, the part of that mapping transformers' class sees: renames of name parts, and
the few tensors sanitize reshapes or drops. The routed experts are streamed, not renamed.
Everything else is found on the model: the MoE block is whichever module of a decoder
layer holds the `experts` that transformers 5 calls with (hidden_states, top_k_index,
top_k_weights) (`mlp`, `block_sparse_moe`, `feed_forward`, `mixer`, or gemma4's decoder
layer itself); its router is `gate` or `router`; the experts' activation is the one
transformers' experts module holds (silu, gemma4's gelu_pytorch_tanh, nemotron_h's
relu2); shared experts, dense layers, Mamba / linear-attention mixers and their caches
stay transformers' own.

Runs, with greedy tokens and fp32 logits as the MLX path's (tests/test_cuda_families.py):
the 25 MoE families that transformers builds and mlx-lm reads from a Hugging Face
checkpoint (scripts/make_hf_family_checkpoints.py HF_FAMILIES), afmoe only ungrouped.
Two expert variants: mlx-lm's SwitchGLU (down(act(gate(x)) * up(x)), every family but
one) and SwitchMLP (fc2(act(fc1(x))), nemotron_h's ungated relu2 experts).

Where mlx-lm's model and transformers' differ, the CUDA backend runs mlx-lm's, the model
the pack holds and the MLX path runs:
- ernie4_5_moe: mlx-lm's sanitize drops the router's `moe_statics.e_score_correction_bias`
  (it routes on the softmax alone); the pack has no such tensor, so it is zero here;
- jamba: mlx-lm's block renormalizes the top-k weights, transformers' router does not;
- phimoe: mlx-lm's SuScaledRoPE uses the long factors and long_mscale at every length,
  transformers' longrope the short ones up to original_max_position_embeddings.
DeepSeek sparse attention (deepseek_v32, glm_moe_dsa) is the same computation in both, but
past index_topk tokens its indexer scores (a ReLU) tie at zero on small random models, and
torch.topk and mx.argpartition break ties differently: the tests stay within index_topk.

Refused, with one line naming the model_type and the reason (`refusal()`):
- afmoe with n_group > 1: mlx-lm routes within the top topk_group expert groups,
  transformers' AfmoeTokenChoiceRouter ignores groups, so the two would route differently
  (n_group 1 runs);
- the other MoE families edgemoe packs from mlx-lm checkpoints (`UNSUPPORTED`): the ones
  transformers 5.24 has no model for; gpt_oss, whose experts have biases and a clamped
  SwiGLU; multimodal or nested-text configs AutoModelForCausalLM does not build (kimi_k25,
  llama4, minimax_m3_vl, mistral4, qwen3_5, qwen3_5_moe, qwen3_vl_moe, step3p5); and those
  whose transformers checkpoint mlx-lm does not read, so that no mapping of names was ever
  checked against the MLX path (bailing_hybrid, kimi_linear, longcat_flash, mimo_v2_flash,
  minimax).
"""

import copy
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import nn
from transformers import PreTrainedConfig

from ..format.pack import PackError


def _kv_b_proj(state: dict, model) -> dict:
    """deepseek_v3-style MLA: mlx-lm splits kv_b_proj (H * (nope + v), rank) into embed_q
    (H, rank, nope), transposed, and unembed_out (H, v, rank); join them back."""
    for name in [n for n in state if n.endswith(".self_attn.embed_q.weight")]:
        prefix = name[:-len("embed_q.weight")]
        wk = state.pop(name)
        wv = state.pop(f"{prefix}unembed_out.weight")
        joined = torch.cat([wk.transpose(-1, -2), wv], dim=1)
        state[f"{prefix}kv_b_proj.weight"] = joined.reshape(-1, joined.shape[-1])
    return state


def _conv1d(state: dict, model) -> dict:
    """mlx-lm's Conv1d weights are (out, kernel, in / groups), PyTorch's (out, in / groups,
    kernel): the Mamba, linear-attention and short-convolution mixers'."""
    convs = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, nn.Conv1d)}
    return {name: t.transpose(1, 2).contiguous() if name in convs else t
            for name, t in state.items()}


def _minus_one(*suffixes: str) -> Callable:
    """Norm weights mlx-lm's sanitize stores as 1 + w (qwen3_next's RMSNorm scales by 1 + w
    in transformers, by w in mlx-lm)."""

    def subtract(state: dict, model) -> dict:
        return {name: t - 1.0 if name.endswith(suffixes) and t.dim() == 1 else t
                for name, t in state.items()}

    return subtract


def _zeros(*suffixes: str) -> Callable:
    """Tensors of transformers' class that mlx-lm's sanitize drops: zero."""

    def fill(state: dict, model) -> dict:
        device = next(iter(state.values())).device
        for name, t in model.state_dict().items():
            if name.endswith(suffixes) and name not in state:
                state[name] = torch.zeros(t.shape, dtype=t.dtype, device=device)
        return state

    return fill


def _long_rope_only(config: dict) -> dict:
    """mlx-lm's SuScaledRoPE rotates by the long factors and scales by long_mscale at every
    length; transformers' longrope by the short ones up to original_max_position_embeddings."""
    for key in ("rope_scaling", "rope_parameters"):
        rope = config.get(key)
        if isinstance(rope, dict) and "long_factor" in rope:
            config[key] = {**rope, "short_factor": rope["long_factor"],
                           "short_mscale": rope.get("long_mscale", rope.get("short_mscale"))}
    return config


def _grouped_routing(config: dict) -> Optional[str]:
    if (config.get("n_group") or 1) > 1:
        return (f"n_group {config['n_group']}: mlx-lm routes within the top "
                f"{config.get('topk_group')} expert groups, transformers' "
                f"AfmoeTokenChoiceRouter ignores the groups (the routing would differ)")
    return None


@dataclass(frozen=True)
class Family:
    """mlx-lm's resident names -> transformers': `renames` replace name parts (dot-bounded,
    as edgemoe.cuda.lora matches them), then `fixups` ((state, model) -> state) rebuild the
    tensors sanitize reshaped or dropped. `config` rewrites config.json where transformers
    reads a key otherwise than mlx-lm; `renormalize` makes the routed weights of the top-k
    sum to one, as mlx-lm's block does and transformers' router does not; `refuse` says
    why a configuration cannot run (None: it can); `route` calls the router as the block
    does, where that is not router(x) (advisory and prerouted routing call it)."""

    renames: Tuple[Tuple[str, str], ...] = ()
    fixups: Tuple[Callable, ...] = ()
    config: Optional[Callable[[dict], dict]] = None
    renormalize: bool = False
    refuse: Optional[Callable[[dict], Optional[str]]] = None
    route: Optional[Callable] = None  # (block, x (T, D)) -> the router's output


_MLA = Family(fixups=(_kv_b_proj,))
_GRANITE = Family(renames=((".router.layer.", ".router."),))

FAMILIES: Dict[str, Family] = {
    "afmoe": Family(refuse=_grouped_routing,
                    route=lambda block, x: block.router(x[None], block.expert_bias)),
    "deepseek_v2": Family(),
    "deepseek_v3": _MLA,
    "deepseek_v32": _MLA,
    "dots1": Family(),
    "ernie4_5_moe": Family(fixups=(_zeros("moe_statics.e_score_correction_bias"),)),
    "exaone_moe": Family(),
    "gemma4_text": Family(),
    "glm4_moe": Family(),
    "glm4_moe_lite": _MLA,
    "glm_moe_dsa": _MLA,
    "granitemoe": _GRANITE,
    "granitemoehybrid": _GRANITE,
    "jamba": Family(renormalize=True),
    "laguna": Family(renames=((".mlp.gate.proj.", ".mlp.gate."),
                              (".shared_expert.", ".shared_experts."))),
    "lfm2_moe": Family(renames=((".feed_forward.gate_proj.", ".feed_forward.w1."),
                                (".feed_forward.up_proj.", ".feed_forward.w3."),
                                (".feed_forward.down_proj.", ".feed_forward.w2.")),
                       route=lambda block, x: block.gate(x, getattr(block, "expert_bias",
                                                                    None))),
    "mellum": Family(),
    "mixtral": Family(renames=((".block_sparse_moe.gate.", ".mlp.gate."),)),
    "nemotron_h": Family(renames=((".backbone.", ".model."),)),
    "olmoe": Family(),
    "phimoe": Family(renames=((".block_sparse_moe.gate.", ".mlp.router."),),
                     config=_long_rope_only),
    "qwen2_moe": Family(),
    "qwen3_moe": Family(),
    "qwen3_next": Family(fixups=(_minus_one(
        ".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
        ".q_norm.weight", ".k_norm.weight"),)),
    "solar_open": Family(),
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
RENAMES = {name: f.renames for name, f in FAMILIES.items() if f.renames}

_UNCHECKED = ("mlx-lm does not read transformers' checkpoint of it "
              "(scripts/make_hf_family_checkpoints.py), so its names were never mapped")
UNSUPPORTED: Dict[str, str] = {  # model_type (config.json) -> why
    **dict.fromkeys(("Klear", "bailing_moe", "bailing_moe_linear", "deepseek", "deepseek_v41",
                     "hunyuan", "kimi_k3", "kimi_vl", "longcat_flash_ngram", "phixtral"),
                    "transformers 5.24 has no model of this type"),
    "gpt_oss": ("its experts have biases and a clamped SwiGLU; the streamed experts compute "
                "unbiased gate/up/down or fc1/fc2 projections"),
    **dict.fromkeys(("kimi_k25", "llama4", "minimax_m3_vl", "mistral4", "qwen3_5",
                     "qwen3_5_moe", "qwen3_vl_moe", "step3p5"),
                    "its config is a multimodal (or nested text_config) one that "
                    "AutoModelForCausalLM does not build as a text model"),
    **dict.fromkeys(("bailing_hybrid", "kimi_linear", "longcat_flash", "mimo_v2_flash",
                     "minimax"), _UNCHECKED),
}


def refusal(config: dict) -> Optional[str]:
    """Why the CUDA backend does not run the model of `config` (config.json), or None."""
    model_type = config.get("model_type")
    if model_type in FAMILIES:
        refuse = FAMILIES[model_type].refuse
        reason = refuse(config) if refuse else None
        return f"model_type {model_type!r}: {reason}" if reason else None
    if model_type in UNSUPPORTED:
        return f"model_type {model_type!r}: {UNSUPPORTED[model_type]}"
    return (f"model_type {model_type!r}: the CUDA backend runs "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}")


def check_runs(config: dict, config_file) -> None:
    """Refuse, in one line naming `config_file`, a model this backend does not run."""
    reason = refusal(config)
    if reason:
        raise PackError(f"{config_file}: {reason}")


def transformers_config(config: dict) -> dict:
    """config.json as transformers' class is to read it: its tagged floats decoded
    ({"__float__": "Infinity"}) and the family's rewrite applied."""
    config = PreTrainedConfig._decode_special_floats(config)
    rewrite = FAMILIES[config["model_type"]].config
    return rewrite(copy.deepcopy(config)) if rewrite else config


def resident(model_type: str, state: dict, model) -> dict:
    """A pack's resident state dict (mlx-lm's names) as transformers' class names it."""
    family = FAMILIES[model_type]
    if family.renames:
        state = {_rename(name, family.renames): t for name, t in state.items()}
    for fixup in (_conv1d, *family.fixups):
        state = fixup(state, model)
    return state


def _rename(name: str, renames) -> str:
    for old, new in renames:
        name = f".{name}.".replace(old, new)[1:-1]
    return name


def moe_block(layer: nn.Module) -> Optional[nn.Module]:
    """The module of a decoder layer that holds its routed experts, or None."""
    for _, module in layer.named_modules():
        if isinstance(getattr(module, "experts", None), nn.Module):
            return module
    return None


def router(block: nn.Module) -> Optional[nn.Module]:
    for name in ("gate", "router"):
        if isinstance(getattr(block, name, None), nn.Module):
            return getattr(block, name)
    return None


def route(model_type: str, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The experts `block`'s own router picks for the tokens x (T, D)."""
    return router_output(model_type, block, x)[-1]


def router_output(model_type: str, block: nn.Module, x: torch.Tensor) -> tuple:
    """`block`'s router on the tokens x (T, D), called as the block calls it (transformers
    5's routers return (logits, weights, indices))."""
    call = FAMILIES[model_type].route or (lambda block, x: router(block)(x))
    return call(block, x)


def gated(experts: nn.Module) -> Optional[bool]:
    """Whether transformers' experts module is gated (gate_up_proj, down_proj), ungated
    (up_proj, down_proj), or neither (None)."""
    names = {name for name, _ in experts.named_parameters(recurse=False)}
    if {"gate_up_proj", "down_proj"} <= names:
        return True
    if {"up_proj", "down_proj"} <= names:
        return False
    return None
