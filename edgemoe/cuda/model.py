"""`load()`: a Hugging Face transformers model built from an edgemoe pack, its routed
experts streaming from disk into device slots; and a greedy decode loop.

The model is transformers' own class for the family (its attention, norms, rotary
embedding, router and KV cache), built on the meta device so that no expert weight is
ever allocated; the resident weights are read from the pack's model.safetensors
(mlx-lm names, mapped to transformers' per family by edgemoe.cuda.families), with
MLX-quantized linears and embeddings dequantized to the compute dtype; each MoE block's
`experts` module becomes a StreamingExperts over the layer's slots.
"""

import inspect
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.activations import ACT2FN

from ..format.families import UnsupportedModelError
from ..format.pack import PackError
from ..format.source import BUNDLED_MODEL
from ..load_plan import Backend, LoadPlan, plan_load
from ..mlx_backend.families import find_experts as mlx_lm_experts, model_args as mlx_lm_args
from ..options import StreamOptions
from ..streaming.budget import SlotPlan
from ..streaming.cache import DEFAULT_POLICY
from ..streaming.store import ExpertStore
from .experts import StreamingExperts
from . import families
from .families import RENAMES, SUPPORTED_MODEL_TYPES  # noqa: F401  (their home is families)
from . import prerouted
from .int4 import dequantize
from .lora import apply_adapter, read_adapter
from .host import HostTier, staging_rows
from .slots import DeviceSlotMemory
from .streams import make_streams

DEFAULT_MODEL = BUNDLED_MODEL
NOT_CONFIG = ("quantization", "quantization_config")  # MLX's; transformers would act on it


def load(path_or_hf_repo: Optional[str] = None, options: Optional[StreamOptions] = None,
         *, device="cuda", dtype=None, streams=None, kernel: Optional[bool] = None,
         tokenizer: bool = True, host_budget=None, host_policy: str = DEFAULT_POLICY,
         copy_streams: int = 1, **overrides):
    """The pack's model on `device` holding at most `expert_budget` of its experts.

    The streaming options are `options` (a StreamOptions) with `overrides` of its fields,
    as `edgemoe.load` takes them (the same names and defaults); the keyword-only rest is
    this backend's own. `expert_budget="auto"` (the default) is what fits in the device's
    free memory (the host's available memory on the CPU) beside the resident weights,
    dequantized to `dtype`, and a 4096-token KV cache. `distributed` is MLX's alone.

    `path_or_hf_repo` is a pack or an mlx-lm quantized checkpoint (a folder, or a hub id
    as edgemoe.hub resolves it; default: the bundled model). `routing` (a
    RoutingMode or its name) is "native" or "advisory": the next MoE layer's own router,
    applied to this layer's input, prefetches that layer's experts while this one
    computes (gated by its precision, as in the MLX path); the router still decides, so
    the output is native's.
    "prerouted": the prerouter heads' prediction, made a token ahead, is the routing of
    every MoE layer but the heads' native layers, and its experts are read ahead (as the
    MLX path: edgemoe.cuda.prerouted). `prerouter_path` is the heads' folder, or None or
    "pack" for the ones the pack carries (PACK/prerouter).

    `dtype` defaults to bfloat16 on a GPU and float32 on the CPU. `streams` orders
    copies and compute (edgemoe.cuda.streams; tests pass a fake). `kernel` uses the
    Triton int4 kernel for decode rows; by default on a GPU when Triton is installed.
    `host_budget` (a fraction, "25%" or "8GB" of the routed experts, as `expert_budget`)
    is the host-memory tier between the disk and the device slots: records that the
    device gave up stay in RAM, so loading them again costs a copy, not a read; its own
    `host_policy` decides what it keeps. Without it the tier is only the pinned staging
    rows the copies need (edgemoe.cuda.host). `copy_streams` is the number of copy
    streams on a GPU (a slot's copies all go on one).
    `adapter_path` is a LoRA adapter folder (mlx-lm's format), or "pack" for the one the
    pack carries (PACK/adapter): served unmerged, as the MLX path does (edgemoe.cuda.lora),
    the routed experts' deltas streamed into their slots with them (edgemoe.format.deltas).
    Returns (model, tokenizer or None); the store is at `model.expert_store`.
    """
    options = StreamOptions.of(options, **overrides)
    if options.distributed:
        raise ValueError("--distributed: the CUDA backend runs on one host")
    if options.experts_per_token is not None:  # (transformers' routers hold their own k)
        raise ValueError(f"experts_per_token {options.experts_per_token}: the CUDA backend "
                         f"routes each token to the model's own experts; reduced top-k "
                         f"(--experts-per-token) is the MLX backend's")
    if options.prefill_arithmetic == "blas":
        raise ValueError(f"--prefill-arithmetic {options.prefill_arithmetic}: the MLX "
                         f"backend's CPU path; the CUDA backend computes as it does")
    device = torch.device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    backend = CudaBackend(device, dtype, streams or make_streams(device, copy_streams),
                          host_budget, host_policy, kernel)
    plan = plan_load(path_or_hf_repo, options, backend)
    with plan.building():  # the store's reader threads end with a failed load
        model = backend.build(plan)
        backend.install_routing(model, plan)
    model.expert_store = plan.store
    model.eval()
    return model, (AutoTokenizer.from_pretrained(plan.path) if tokenizer else None)


class CudaBackend(Backend):
    """The plan's PyTorch side: slots in device memory over a host tier; the family, the
    adapter and the heads checked (and read) before the store starts."""

    def __init__(self, device: torch.device, dtype, streams, host_budget, host_policy: str,
                 kernel: Optional[bool] = None):
        self.device, self.dtype, self.streams = device, dtype, streams
        self.host_budget, self.host_policy, self.kernel = host_budget, host_policy, kernel
        self.where = f"{device.type} "
        self.adapter = self.heads = None  # read by check()

    def check_family(self, config: dict, config_path: Path) -> None:
        families.check_runs(config, config_path)

    def find_experts(self, config: dict, config_path: Path):
        """An mlx-lm checkpoint's routed experts are where mlx-lm's model for its config
        holds them: mlx-lm's classes find them, imported only for a checkpoint read in
        place (edgemoe.mlx_backend.families)."""
        return mlx_lm_experts(config, config_path)

    def model_args(self, config: dict) -> Optional[dict]:
        """The KV cache sized as on the MLX backend, by mlx-lm's reading of the config
        (by the config alone without mlx-lm)."""
        try:
            return mlx_lm_args(config)
        except ImportError:
            return None

    def check(self, plan: LoadPlan) -> None:
        if plan.adapter is not None:
            self.adapter = read_adapter(plan.adapter, streamed=[layer.module for layer
                                                                in plan.opened.layers])
        if plan.heads is not None:
            self.heads = prerouted.load_heads(plan.heads, self.device)

    def memory_bytes(self) -> Optional[int]:
        """The device's free memory (the host's available memory on the CPU)."""
        return torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else None

    def resident_bytes(self, plan: LoadPlan) -> int:
        return _resident_bytes(plan.path, plan.config, self.dtype,
                               streamed_prefixes(plan.source))

    def slot_memory(self, plan: LoadPlan):
        rows = host_rows(SlotPlan.of(plan.source), self.host_budget)
        return lambda layer, n: DeviceSlotMemory(
            layer, n, self.device, self.streams,
            HostTier(layer, rows, self.streams, self.host_policy))

    def build(self, plan: LoadPlan):
        model = _build(plan.config, self.dtype)
        _install(model, plan.store, _kernel(self.device, self.kernel))
        _load_resident(model, plan.path, plan.config, self.dtype, self.device,
                       skip=streamed_prefixes(plan.source))
        if self.adapter is not None:
            apply_adapter(model, self.adapter, RENAMES.get(plan.config["model_type"], ()))
        return model

    def install_routing(self, model, plan: LoadPlan) -> None:
        if plan.routing.advisory:
            _advise(model, plan.store)
        if plan.routing.routes:  # (the heads check() read: the mode needs them)
            try:
                prerouted.install(model, plan.store, self.heads)
            except UnsupportedModelError as e:  # a router it cannot route by given logits
                raise UnsupportedModelError(f"{plan.config_path}: {e}") from None


def streamed_prefixes(source) -> tuple:
    """The resident files' names the streamed experts start with (never loaded whole)."""
    return tuple(f"{layer.module}." for layer in source.layers)


def _resident_bytes(path: Path, config: dict, dtype, skip=()) -> int:
    """The resident weights' size on the device: quantized ones dequantized to `dtype`
    (as resident_state_dict loads them), read from the safetensors headers."""
    element, quantization = torch.empty((), dtype=dtype).element_size(), config.get(
        "quantization", {})
    total = 0
    for f in sorted(path.glob("model*.safetensors")):
        with safe_open(str(f), "pt") as tensors:
            names = {n for n in tensors.keys() if not n.startswith(skip)}
            for name in names - {n for n in names if n.endswith((".scales", ".biases"))}:
                count = math.prod(tensors.get_slice(name).get_shape())
                q = _quantization_of(name, names, quantization)
                total += (count if q is None else count * 32 // q["bits"]) * element
    return total


def host_rows(plan: SlotPlan, host_budget) -> int:
    """Host-tier rows per MoE layer: what `host_budget` buys, at least the staging rows."""
    bought = plan.slots_for_bytes(plan.budget_bytes(host_budget)) if host_budget else 0
    return max(staging_rows(plan.top_k), bought)


def _build(config: dict, dtype) -> torch.nn.Module:
    config = families.transformers_config(config)
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
    family = families.FAMILIES[model.config.model_type]
    layers = model.model.layers
    for module, slots in store.layers.items():
        block = families.moe_block(layers[slots.layer.index])
        if block is None or families.router(block) is None:
            raise PackError(f"{store.info().path}: layer {slots.layer.index} of the model has "
                            f"no MoE block, but the manifest streams {module}")
        found = list(inspect.signature(block.experts.forward).parameters)
        if found[:3] != EXPERTS_CALL:
            raise RuntimeError(f"{type(block.experts).__name__}.forward takes {found}; "
                               f"edgemoe.cuda replaces an experts module called with "
                               f"{EXPERTS_CALL} (transformers 5)")
        act = getattr(block.experts, "act_fn", None) or ACT2FN[model.config.hidden_act]
        streaming = StreamingExperts(slots, act, kernel, renormalize=family.renormalize)
        if families.gated(block.experts) != streaming.gated:
            raise PackError(f"{store.info().path}: {module} holds {streaming.projections} "
                            f"experts; {type(block.experts).__name__} is "
                            f"{'un' if streaming.gated else ''}gated")
        block.experts = streaming


def _advise(model, store: ExpertStore):
    """Advisory routing: each MoE layer's input through the next MoE layer's router (its
    top-k) is a prefetch for that layer; prefetches are gated by their precision."""
    blocks = {slots.layer.index: families.moe_block(model.model.layers[slots.layer.index])
              for slots in store.layers.values()}
    layers = sorted(blocks)
    store.gate_prefetches(True)
    for layer, target in zip(layers, layers[1:]):

        def advise(x, target=target, block=blocks[target]):
            with torch.no_grad():
                indices = families.route(model.config.model_type, block, x)
            store.prefetch(target, indices.reshape(-1).cpu().numpy())

        blocks[layer].experts.advise = advise


def _load_resident(model, path: Path, config: dict, dtype, device, skip=()):
    """Assign the resident weights (a pack's model.safetensors, or an mlx-lm checkpoint's
    shards less the streamed experts, names starting with `skip`) to the meta model, then
    check nothing is left."""
    state = {}
    for f in sorted(path.glob("model*.safetensors")):
        state.update(resident_state_dict(f, config.get("quantization", {}), dtype, device, skip))
    state = families.resident(config["model_type"], state, model)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if unexpected:
        raise PackError(f"{path}: weights the model does not have: {unexpected[:5]}")
    if config.get("tie_word_embeddings") and "lm_head.weight" in missing:
        model.tie_weights()
        missing.remove("lm_head.weight")
    if missing:
        raise PackError(f"{path}: weights missing for {missing[:5]}")
    _computed_buffers(model, device)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers())
            if t.is_meta]
    if left:
        raise PackError(f"{path}: no weights for {left[:5]}")


@torch.no_grad()
def _computed_buffers(model, device):
    """The buffers a model computes rather than stores (rotary frequencies, gemma4's
    embedding scale) on `device`, filled as transformers' from_pretrained fills them: by
    the model's own `_init_weights`, the loaded tensors marked as initialized."""
    for tensor in model.state_dict(keep_vars=True).values():
        tensor._is_hf_initialized = True
    owners = {}
    for name, buffer in list(model.named_buffers()):
        if buffer.is_meta:
            owner, _, attr = name.rpartition(".")
            module = model.get_submodule(owner)
            module._buffers[attr] = torch.empty_like(buffer, device=device)
            owners[owner] = module
    for module in owners.values():
        model._init_weights(module)


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
            module, q = name.rsplit(".", 1)[0], _quantization_of(name, names, quantization)
            if q is not None:
                tensor = dequantize(tensor.view(torch.int32), f.get_tensor(f"{module}.scales"),
                                    f.get_tensor(f"{module}.biases"), q["group_size"], q["bits"])
            state[name] = tensor.to(device=device, dtype=dtype)
    return state


def _quantization_of(name: str, names, quantization: dict) -> Optional[dict]:
    """The quantization of a resident tensor that is a quantized weight (mlx-lm's: its
    module has scales beside it; the module's own entry or the model's), else None."""
    module = name.rsplit(".", 1)[0]
    if name.endswith(".weight") and f"{module}.scales" in names:  # not its .bias
        return quantization.get(module) or quantization
    return None


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
    cache = {_cache_argument(model): DynamicCache(config=model.config)}  # hybrid layer types
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
