"""`load()`: a Hugging Face transformers model built from an edgemoe pack, its routed
experts streaming from disk into device slots; and a greedy decode loop.

The model is transformers' own class for the family (its attention, norms, rotary
embedding, router and KV cache), built on the meta device so that no expert weight is
ever allocated; the resident weights are read from the pack's model.safetensors
(mlx-lm names, transformers' names too but for Mixtral's router), with MLX-quantized
linears and embeddings dequantized to the compute dtype; each MoE block's `experts`
module becomes a StreamingExperts over the layer's slots.
"""

import inspect
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.activations import ACT2FN

from ..format.pack import PackError
from ..format.source import BUNDLED_MODEL, model_path, open_source, pack_asset
from ..streaming.cache import DEFAULT_POLICY
from ..streaming.store import ExpertStore
from .experts import StreamingExperts
from .int4 import dequantize
from .slots import DeviceSlotMemory
from .streams import make_streams

DEFAULT_MODEL = BUNDLED_MODEL
SUPPORTED_MODEL_TYPES = ("qwen3_moe", "mixtral", "olmoe")
# mlx-lm's resident names -> transformers' (the routed experts are streamed, not renamed)
RENAMES = {"mixtral": ((".block_sparse_moe.gate.", ".mlp.gate."),)}
NOT_CONFIG = ("quantization", "quantization_config")  # MLX's; transformers would act on it
ROUTINGS = ("native", "advisory")


def load(pack_path=None, expert_budget=1.0, device="cuda", dtype=None,
         cache_policy: str = DEFAULT_POLICY, io: str = "buffered", streams=None,
         kernel: Optional[bool] = None, tokenizer: bool = True, routing: str = "native"):
    """The pack's model on `device` holding at most `expert_budget` of its experts.

    `routing` is "native" or "advisory": the next MoE layer's own router, applied to this
    layer's input, prefetches that layer's experts while this one computes (gated by its
    precision, as in the MLX path); the router still decides, so the output is native's.

    `dtype` defaults to bfloat16 on a GPU and float32 on the CPU. `streams` orders
    copies and compute (edgemoe.cuda.streams; tests pass a fake). `kernel` uses the
    Triton int4 kernel for decode rows; by default on a GPU when Triton is installed.
    Returns (model, tokenizer or None); the store is at `model.expert_store`.
    """
    if routing not in ROUTINGS:
        raise ValueError(f"--routing {routing!r}: the CUDA backend routes "
                         f"{' or '.join(ROUTINGS)}")
    path = model_path(pack_path)
    config = json.loads((path / "config.json").read_text())
    if config.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise PackError(f"{path / 'config.json'}: model_type {config.get('model_type')!r}; "
                        f"the CUDA backend runs {', '.join(SUPPORTED_MODEL_TYPES)}")
    device = torch.device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    streams = streams or make_streams(device)
    store = ExpertStore(open_source(path), expert_budget, cache_policy, io,
                        memory=lambda layer, n: DeviceSlotMemory(layer, n, device, streams),
                        learned_policy=pack_asset(path, "cache_policy"))
    model = _build(config, dtype)
    _install(model, store, _kernel(device, kernel))
    _load_resident(model, path, config, dtype, device, skip=tuple(f"{m}." for m in store.layers))
    if routing == "advisory":
        _advise(model, store)
    model.expert_store = store
    model.eval()
    return model, (AutoTokenizer.from_pretrained(path) if tokenizer else None)


def _build(config: dict, dtype) -> torch.nn.Module:
    hf_config = AutoConfig.for_model(**{k: v for k, v in config.items() if k not in NOT_CONFIG})
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config, dtype=dtype,
                                                attn_implementation="sdpa")


def _kernel(device: torch.device, wanted: Optional[bool]):
    if wanted is False or (wanted is None and device.type != "cuda"):
        return None
    try:
        from ..kernels.int4_moe import gather_qmv
    except ImportError as e:
        if wanted:
            raise
        print(f"[edgemoe] Triton kernel unavailable ({e}); dequantize-and-matmul experts")
        return None
    return gather_qmv


EXPERTS_CALL = ["hidden_states", "top_k_index", "top_k_weights"]  # transformers 5's MoE call


def _install(model, store: ExpertStore, kernel):
    act = ACT2FN[model.config.hidden_act]
    layers = model.model.layers
    for module, slots in store.layers.items():
        block = layers[slots.layer.index].mlp
        if not hasattr(block, "experts") or not hasattr(block, "gate"):
            raise PackError(f"{store.info().path}: layer {slots.layer.index} of the model has "
                            f"no MoE block, but the manifest streams {module}")
        found = list(inspect.signature(block.experts.forward).parameters)
        if found[:3] != EXPERTS_CALL:
            raise RuntimeError(f"{type(block.experts).__name__}.forward takes {found}; "
                               f"edgemoe.cuda replaces an experts module called with "
                               f"{EXPERTS_CALL} (transformers 5)")
        block.experts = StreamingExperts(slots, act, kernel)


def _advise(model, store: ExpertStore):
    """Advisory routing: each MoE layer's input through the next MoE layer's router (its
    top-k) is a prefetch for that layer; prefetches are gated by their precision."""
    blocks = {slots.layer.index: model.model.layers[slots.layer.index].mlp
              for slots in store.layers.values()}
    layers = sorted(blocks)
    store.gate_prefetches(True)
    for layer, target in zip(layers, layers[1:]):
        gate = blocks[target].gate

        def advise(x, target=target, gate=gate):
            with torch.no_grad():
                indices = gate(x)[-1]  # transformers 5's routers: (logits, scores, indices)
            store.prefetch(target, indices.reshape(-1).cpu().numpy())

        blocks[layer].experts.advise = advise


def _load_resident(model, path: Path, config: dict, dtype, device, skip=()):
    """Assign the resident weights (a pack's model.safetensors, or an mlx-lm checkpoint's
    shards less the streamed experts, names starting with `skip`) to the meta model, then
    check nothing is left."""
    state = {}
    for f in sorted(path.glob("model*.safetensors")):
        state.update(resident_state_dict(f, config.get("quantization", {}), dtype, device, skip))
    for old, new in RENAMES.get(config["model_type"], ()):
        state = {name.replace(old, new): tensor for name, tensor in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if unexpected:
        raise PackError(f"{path}: weights the model does not have: {unexpected[:5]}")
    if config.get("tie_word_embeddings") and "lm_head.weight" in missing:
        model.tie_weights()
        missing.remove("lm_head.weight")
    if missing:
        raise PackError(f"{path}: weights missing for {missing[:5]}")
    rotary = model.model.rotary_emb  # its buffers are computed, not stored
    with torch.device(device):
        model.model.rotary_emb = type(rotary)(rotary.config)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers())
            if t.is_meta]
    if left:
        raise PackError(f"{path}: no weights for {left[:5]}")


def resident_state_dict(path: Path, quantization: dict, dtype, device,
                        skip=()) -> Dict[str, torch.Tensor]:
    """mlx-lm's resident tensors as float tensors: quantized (weight, scales, biases)
    triples dequantized with the module's own or the model's quantization."""
    state = {}
    with safe_open(str(path), "pt") as f:
        names = {n for n in f.keys() if not n.startswith(skip)}
        for name in sorted(names):
            if name.endswith((".scales", ".biases")):
                continue
            tensor = f.get_tensor(name)
            module = name.rsplit(".", 1)[0]
            if f"{module}.scales" in names:
                q = quantization.get(module) or quantization
                tensor = dequantize(tensor.view(torch.int32), f.get_tensor(f"{module}.scales"),
                                    f.get_tensor(f"{module}.biases"), q["group_size"], q["bits"])
            state[name] = tensor.to(device=device, dtype=dtype)
    return state


@dataclass
class Decoded:
    """Greedy tokens, the logits of the prompt and every step, and timings."""

    tokens: List[int]
    logits: torch.Tensor  # (prompt + steps, vocab)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    step_s: List[float] = field(default_factory=list)


@torch.inference_mode()
def greedy(model, prompt: List[int], max_tokens: int, keep_logits: bool = True,
           forced: Optional[List[int]] = None) -> Decoded:
    """Prefill the prompt, then decode `max_tokens` tokens greedily with a KV cache.

    With `forced`, step i feeds forced[i] instead of the greedy token, so that the
    logits stay comparable with another run's position by position."""
    device = next(model.parameters()).device
    cache = {_cache_argument(model): DynamicCache()}
    tic = time.perf_counter()
    out = model(input_ids=torch.tensor([prompt], device=device), use_cache=True, **cache)
    logits = [out.logits[0].float()] if keep_logits else []
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    result = Decoded([], None)
    result.prefill_s = _sync_time(device) - tic
    for i in range(max_tokens):
        step = time.perf_counter()
        result.tokens.append(token)
        if forced is not None:
            token = torch.tensor([[forced[i]]], device=device)
        out = model(input_ids=token, use_cache=True, **cache)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        if keep_logits:
            logits.append(out.logits[0].float())
        result.step_s.append(time.perf_counter() - step)
    result.decode_s = _sync_time(device) - tic - result.prefill_s
    result.tokens = [int(t) for t in torch.cat(result.tokens).view(-1).tolist()]
    result.logits = torch.cat(logits) if keep_logits else None
    return result


def _cache_argument(model) -> str:
    """transformers renamed `past_key_values` to `cache` (5.2x); take what forward takes."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _sync_time(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
