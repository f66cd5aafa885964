"""`load()`: an edgemoe pack as an mlx-lm model whose routed experts stream from disk."""

import json
from pathlib import Path
from typing import Any, Dict, Optional

from mlx_lm.utils import _get_classes, load_adapters, load_model, load_tokenizer

from .cache import DEFAULT_POLICY
from .experts import install
from .families import check_supported
from .pack import Pack
from .store import ExpertStore


def load(
    path_or_hf_repo: str,
    expert_budget=1.0,
    tokenizer_config: Optional[Dict[str, Any]] = None,
    model_config: Optional[Dict[str, Any]] = None,
    adapter_path: Optional[str] = None,
    lazy: bool = False,
    return_config: bool = False,
    cache_policy: str = DEFAULT_POLICY,
):
    """Load a pack like `mlx_lm.load`, holding at most `expert_budget` of its experts.

    `expert_budget` is a fraction of all routed-expert bytes (0.25), a byte count, or
    a string such as "25%" or "2GB". The model is mlx-lm's own class for the family
    with each MoE block's expert module streaming from the pack; it is called like
    any mlx-lm model and works with mlx-lm's generate_step, samplers and KV caches.
    The store is at `model.expert_store`.
    """
    path = Path(path_or_hf_repo)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such model folder")
    config_path = path / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{path}: no config.json; is this a model folder?")
    check_supported(json.loads(config_path.read_text()), config_path)
    store = ExpertStore(Pack.open(path), expert_budget, cache_policy)

    def streaming_classes(config):
        model_class, args_class = _get_classes(config)

        def build(args):
            return install(model_class(args), store)

        return build, args_class

    model, config = load_model(path, lazy, model_config=model_config,
                               get_model_classes=streaming_classes)
    model.expert_store = store
    if adapter_path is not None:
        model = load_adapters(model, adapter_path)
        model.eval()
    tokenizer = load_tokenizer(path, tokenizer_config,
                               eos_token_ids=config.get("eos_token_id", None))
    if return_config:
        return model, tokenizer, config
    return model, tokenizer
