"""`load()`: an MoE model whose routed experts stream from disk, as an mlx-lm model."""

import sys
from typing import Any, Dict, Optional

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes, load_model, load_tokenizer
from transformers.tokenization_utils_base import VERY_LARGE_INTEGER as VERY_LONG

from ..distributed import connect, share_for
from ..load_plan import Backend, LoadPlan, plan_load
from ..options import StreamOptions
from .driver import PredictedRouting
from .gates import hand_input, moe_blocks
from .conditional import experts_per_token, reduce_top_k
from .predictors import predictor_for
from ..routing.modes import ExpertsPerToken
from ..streaming.telemetry import drop_cached_pages
from .experts import Streaming, install, streaming_class
from .families import check_runs, find_experts, model_args, routed_experts
from .lora import load_adapter
from .prefill import use_blas
from .slots import MLXSlotMemory


def load(
    path_or_hf_repo: Optional[str] = None,
    options: Optional[StreamOptions] = None,
    *,
    tokenizer_config: Optional[Dict[str, Any]] = None,
    model_config: Optional[Dict[str, Any]] = None,
    lazy: bool = False,
    return_config: bool = False,
    group=None,
    **overrides,
):
    """Load a model like `mlx_lm.load`, holding at most `expert_budget` of its experts.

    The streaming options are `options` (a StreamOptions) with `overrides` of its fields
    (`load(path, expert_budget=0.25, routing="prerouted")`), as `edgemoe.cuda.load` takes
    them; `tokenizer_config`, `model_config`, `lazy`, `return_config` and `adapter_path`
    are mlx-lm's. `path_or_hf_repo` is an edgemoe pack or an mlx-lm quantized checkpoint,
    read in place (default: the bundled model): a folder, or a Hugging Face hub
    id (`org/name`, `org/name@revision`), downloaded once into the hub cache (edgemoe.hub).
    `routing` (a RoutingMode, or its name: edgemoe.routing.modes) is "native" (the model's
    own router, loads on demand), "advisory" (a predictor prefetches the next layer's
    experts; the router still decides, so outputs are the same) or "prerouted" (the
    prerouter heads' prediction is the routing, read a whole token ahead). `io` is
    "buffered" or "direct" (O_DIRECT, bypassing the page cache). `prerouter_path` names
    trained heads (edgemoe.train_prerouter); prerouted defaults to the heads the pack
    carries (PACK/prerouter), and "pack" names them. `adapter_path` is an
    adapter folder, "pack" for the one the pack carries (PACK/adapter), or "none"; by
    default, the one the heads carry for their routing, if any (their config's
    `adapter`: edgemoe.routing.between --adapter). An adapter of
    the routed experts has their deltas streamed with them (edgemoe.format.deltas). A pack's own
    cache_policy.npz serves `cache_policy="learned"`. A read that keeps compute waiting
    over `read_timeout` seconds fails the call with a PackError. With `verify` (the
    default) a pack's resident tensors are checked against their CRC32s before loading, and
    every expert record as it is read; so are an mlx-lm checkpoint's read in place once
    `edgemoe.verify` has indexed its checksums (without an index, stderr says they are not
    checked).

    `group` (an `mx.distributed` group of several hosts, e.g. edgemoe.distributed.connect(),
    which `distributed=True` calls) makes this process one host of several: it holds,
    reads and budgets only its share of the routed experts (a percentage budget is of
    that share), and the hosts' outputs are summed at every MoE layer, bit-identical to one host (edgemoe.distributed). The share
    is the one a shard pack carries (convert --shard), else balanced by the routing trace
    `partition` (a .npz), else round-robin. A collective waiting over `group_timeout`
    seconds means a host is gone: the process exits with an error naming it.

    The model is mlx-lm's own class for the family with each MoE block's expert
    module streaming from disk; it works with mlx-lm's generate_step, samplers and
    KV caches. Its store is `model.expert_store` (see ExpertStore: `info()`,
    `snapshot()`, `start_trace()`).
    """
    options = StreamOptions.of(options, **overrides)
    if group is None and options.distributed:
        group = connect(options.group_timeout)
    backend = MLXBackend(group, lazy, model_config)
    plan = plan_load(path_or_hf_repo, options, backend)
    with plan.building():
        model = backend.build(plan)
        _reduce_experts(model, plan, backend.install_routing)
        if plan.adapter is not None:
            model = load_adapter(model, plan.adapter, streamed_experts=plan.deltas is not None)
            model.eval()
        if options.prefill_arithmetic == "blas":  # (an explicit, inexact option)
            use_blas(model, backend.experts)
    config = backend.config
    tokenizer = load_tokenizer(plan.path, tokenizer_config,
                               eos_token_ids=config.get("eos_token_id", None))
    # a tokenizer's model_max_length (512 in the bundled one's config) is no limit here:
    # the model's context is, checked where a prompt is taken; no warning per long prompt
    tokenizer._tokenizer.model_max_length = VERY_LONG
    if return_config:
        return model, tokenizer, config
    return model, tokenizer


class MLXBackend(Backend):
    """The plan's MLX side: slots in unified memory; a group of hosts shares the experts.
    `lazy` and `model_config` are mlx-lm's; the build leaves mlx-lm's `config` and the
    streaming expert modules by layer (`experts`) here."""

    def __init__(self, group=None, lazy: bool = False, model_config=None):
        self.group, self.lazy, self.model_config = group, lazy, model_config
        self.config, self.experts = None, {}

    def check_family(self, config: dict, config_path) -> None:
        check_runs(config, config_path)

    def find_experts(self, config: dict, config_path):
        return find_experts(config, config_path)

    def model_args(self, config: dict) -> dict:
        return model_args(config)

    def share(self, plan: LoadPlan):
        if self.group is None or self.group.size() == 1:
            return plan.opened, None
        options = plan.options
        return share_for(plan.opened, self.group, options.partition, options.group_timeout)

    def slot_memory(self, plan: LoadPlan):
        return MLXSlotMemory

    def build(self, plan: LoadPlan):
        model, self.config, self.experts = _build(plan, self.lazy, self.model_config)
        return model

    def install_routing(self, model, plan: LoadPlan) -> None:
        _install_routing(model, plan, self.experts)


def _build(plan: LoadPlan, lazy: bool, model_config):
    """(mlx-lm's model for the family, each MoE block's experts streaming from the plan's
    store; its config; {layer: streaming expert module})."""
    streaming = Streaming(plan.store, plan.share)
    experts = {}

    def streaming_classes(config):
        model_class, args_class = _get_classes(config)

        def build(args):
            model = streaming_class(model_class, plan.store.layers)(args)
            model.streaming = streaming
            # a family with none is refused here; a config.json that routes otherwise than
            # the pack was written for, too
            plan.opened.check_routing(*routed_experts(model, plan.config_path),
                                      plan.config_path)
            experts.update(install(model, streaming))
            return model

        return build, args_class

    uncached = plan.options.io == "direct" and not lazy
    model, config = load_model(plan.path, lazy or uncached, model_config=model_config,
                               get_model_classes=streaming_classes)
    if uncached:
        _load_uncached(model, plan.source.resident_files)
    return model, config, experts


def _reduce_experts(model, plan: LoadPlan, install_routing) -> None:
    """--experts-per-token on every MoE block, before the routing mode is installed (its
    predictors and cache-conditional taps route to the reduced k), and what each token
    routes to after it (heads may reduce it too: the smaller k wins) on model.streaming."""
    blocks = moe_blocks(model)
    own = reduce_top_k(blocks, plan.options.experts_per_token)
    install_routing(model, plan)
    experts = ExpertsPerToken(experts_per_token(blocks), own)
    model.streaming.experts_per_token = experts
    if experts.reduced:
        print(f"[edgemoe] each token routes to {experts} experts (reduced top-k: not "
              f"exact)", file=sys.stderr)


def _install_routing(model, plan: LoadPlan, experts: dict):
    """A predicting mode's predictor, reading ahead through the store."""
    routing, store = plan.routing, plan.store
    if not (routing.advisory or routing.routes):  # native: the router alone
        return
    blocks = moe_blocks(model)
    predictor = predictor_for(routing, plan.heads, blocks, store.info().slots_per_layer,
                              store.new_policy)
    store.gate_prefetches(routing.gates_prefetches)
    model.streaming.routing = PredictedRouting(predictor, store.prefetch)
    for layer, block in blocks.items():
        hand_input(block, experts[layer].block_input)


def _load_uncached(model, files, chunk_bytes: int = 32 * 2**20):
    """Read the resident weights a chunk at a time, dropping the files' cached pages after
    each, so that with --io direct they are held once (as arrays) and never a second time
    in the page cache, not even while loading."""
    batch, size = [], 0
    for _, p in tree_flatten(model.parameters()):
        batch.append(p)
        size += p.nbytes
        if size >= chunk_bytes:
            mx.eval(batch)
            batch, size = [], 0
            for f in files:
                drop_cached_pages(f)
    mx.eval(batch)
    for f in files:
        drop_cached_pages(f)


