"""`load()`: an MoE model whose routed experts stream from disk, as an mlx-lm model."""

import json
from pathlib import Path
from typing import Any, Dict, Optional

from mlx_lm.utils import _get_classes, load_adapters, load_model, load_tokenizer

from .cache import DEFAULT_POLICY
from .experts import install
from .families import check_supported
from .inplace import open_mlx_lm
from .pack import MANIFEST, Pack
from .predictor import NextRouterPredictor
from .prerouter import PreroutedPredictor, PrerouterPredictor, load_prerouter, moe_blocks
from .store import ExpertStore

ROUTING_MODES = ("native", "advisory", "prerouted", "prerouted-set")
DEFAULT_MODEL = Path(__file__).parent / "models" / "reference"  # bundled with the package


def open_source(path: Path) -> Pack:
    """An edgemoe pack, or an mlx-lm quantized checkpoint read in place."""
    return Pack.open(path) if (path / MANIFEST).exists() else open_mlx_lm(path)


def load(
    path_or_hf_repo: Optional[str] = None,
    expert_budget=1.0,
    tokenizer_config: Optional[Dict[str, Any]] = None,
    model_config: Optional[Dict[str, Any]] = None,
    adapter_path: Optional[str] = None,
    lazy: bool = False,
    return_config: bool = False,
    routing: str = "native",
    cache_policy: str = DEFAULT_POLICY,
    io: str = "buffered",
    prerouter_path: Optional[str] = None,
):
    """Load a model like `mlx_lm.load`, holding at most `expert_budget` of its experts.

    `path_or_hf_repo` is an edgemoe pack, or an mlx-lm quantized checkpoint, read in
XX `routing` is "native" (the model's own
    router, loads on demand), "advisory" (a predictor prefetches the next layer's
    experts; the router still decides, so outputs are the same), "prerouted" (the
    prerouter heads' prediction is the routing, read a whole token ahead) or
    "prerouted-set" (the predicted experts, weighed by the native router). `io` is "buffered"
    or "direct" (O_DIRECT, bypassing the page cache). `prerouter_path` names trained
    prerouter heads (edgemoe.train_prerouter) to predict with in advisory mode instead
    of the next layer's router.

    The model is mlx-lm's own class for the family with each MoE block's expert
    module streaming from disk; it works with mlx-lm's generate_step, samplers and
    KV caches. The store is at `model.expert_store`.
    """
    if routing not in ROUTING_MODES:
        raise ValueError(f"routing {routing!r}: choose one of {', '.join(ROUTING_MODES)}")
    path = Path(path_or_hf_repo) if path_or_hf_repo is not None else DEFAULT_MODEL
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such model folder")
    config_path = path / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{path}: no config.json; is this a model folder?")
    check_supported(json.loads(config_path.read_text()), config_path)
    store = ExpertStore(open_source(path), expert_budget, cache_policy, io)
    blocks = {}

    def streaming_classes(config):
        model_class, args_class = _get_classes(config)

        def build(args):
            model = model_class(args)
            blocks.update(install(model, store))
            return model

        return build, args_class

    model, config = load_model(path, lazy, model_config=model_config,
                               get_model_classes=streaming_classes)
    model.expert_store = store
    if routing.startswith("prerouted"):
        if prerouter_path is None:
            raise ValueError(f"routing {routing!r} needs prerouter heads: pass prerouter_path "
                             f"(python -m edgemoe.train_prerouter makes them)")
        store.predictor = PreroutedPredictor(load_prerouter(prerouter_path), moe_blocks(model),
                                             confine=routing == "prerouted-set")
    elif routing == "advisory" and prerouter_path is not None:
        store.predictor = PrerouterPredictor(load_prerouter(prerouter_path), moe_blocks(model))
    elif routing == "advisory":
        store.predictor = NextRouterPredictor(blocks)
    if adapter_path is not None:
        model = load_adapters(model, adapter_path)
        model.eval()
    tokenizer = load_tokenizer(path, tokenizer_config,
                               eos_token_ids=config.get("eos_token_id", None))
    if return_config:
        return model, tokenizer, config
    return model, tokenizer
