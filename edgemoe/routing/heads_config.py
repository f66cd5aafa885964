"""The prerouter heads' folder and config, as both backends read them: the MLX path
(edgemoe.mlx_backend.prerouter, .predictors) and the CUDA backend (edgemoe.cuda.prerouted).
Neither MLX nor PyTorch here.

    PREROUTER/prerouter.safetensors   the heads' weights (`heads.layer_<target>.*`)
    PREROUTER/prerouter_config.json   PrerouterConfig: which layer's head runs where

The config says which MoE layer each head predicts (its target) and at which it runs (its
source), which layers keep the native router, and whether the heads predict the next
token or this one, and optionally a mode between exact and predicted routing
(`route_top_k`, `conditional`: edgemoe.routing.between, docs/routing.md), and the adapter
measured with that routing (`adapter`: PREROUTER/<adapter>/, a LoRA folder, loaded with the
heads unless another adapter is given). Heads saved before the head variants left (#44; their figures:
docs/benchmarks.md, "Variants") record each variant's field; the shipped heads hold the
plain values. A field of a removed variant loads at its plain value only.
"""

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

WEIGHTS = "prerouter.safetensors"
CONFIG = "prerouter_config.json"
# a removed variant's field -> its plain value
RETIRED = {"head_hidden": 256, "first_layer": False, "history": 1, "inputs": 1, "depth": 1}
HEAD_HIDDEN = RETIRED["head_hidden"]  # the width of every head


@dataclass
class PrerouterConfig:
    model_type: str
    hidden_size: int  # of the model: the MoE blocks' input
    num_experts: int
    top_k: int
    sources: Dict[int, int]  # target MoE layer -> the MoE layer its head runs at
    same_token: bool = False  # predict layer l+1 of token t, not of token t+1
    native_layers: List[int] = field(default_factory=list)  # keep the native router here
    # modes between exact and predicted (edgemoe.mlx_backend.conditional; MLX only):
    route_top_k: int = 0  # > 0: every MoE layer routes to its k most likely (reduced top-k)
    conditional: int = 0  # > 0: the router chooses among the experts in slots and the heads'
    #                       m most likely, which are read a token ahead (cache-conditional)
    adapter: str = ""  # a LoRA folder inside the heads' folder, loaded with them when no
    #                    adapter is given (edgemoe.routing.between --adapter)

    @classmethod
    def for_layers(cls, model_type: str, hidden_size: int, layers: Sequence[int],
                   num_experts: int, top_k: int, same_token: bool = False,
                   native_layers: Sequence[int] = ()) -> "PrerouterConfig":
        """A head for every MoE layer (`layers`) but the first (it has no previous MoE
        layer: it keeps its router)."""
        layers = sorted(layers)
        sources = dict(zip(layers[1:], layers[:-1]))
        native = {layers[0], *native_layers}
        return cls(model_type, hidden_size, num_experts, top_k, sources, same_token,
                   sorted(native))

    @property
    def lead(self) -> int:
        """1: the heads predict the next token's routing (their target's next call); 0:
        this token's (same-token heads)."""
        return 0 if self.same_token else 1

    @property
    def plain(self) -> bool:
        """The heads' prediction is the routing, at the model's top-k."""
        return not (self.route_top_k or self.conditional)

    @property
    def targets(self) -> List[int]:
        return sorted(self.sources)

    @property
    def layers(self) -> List[int]:
        """The MoE layers the heads run at or predict."""
        return sorted(set(self.sources) | set(self.sources.values()))

    @property
    def targets_of(self) -> Dict[int, List[int]]:
        """{source MoE layer: the targets whose heads run there}."""
        found: Dict[int, List[int]] = {}
        for target, source in sorted(self.sources.items()):
            found.setdefault(source, []).append(target)
        return found

    @property
    def predicted_layers(self) -> List[int]:
        """Targets whose routing a prerouted mode takes from the heads."""
        return [t for t in self.targets if t not in self.native_layers]

    def to_json(self) -> dict:
        d = asdict(self)
        d["sources"] = {str(t): s for t, s in self.sources.items()}
        return d

    @classmethod
    def from_json(cls, d: dict) -> "PrerouterConfig":
        d = dict(d)
        d["sources"] = {int(t): int(s) for t, s in d["sources"].items()}
        return cls(**d)


def current_fields(raw: dict, path) -> dict:
    """`raw`, the JSON of `path`, without the removed variants' fields; one at another
    value than its plain one is a ValueError naming the file and the field."""
    for name, plain in RETIRED.items():
        if name in raw and raw[name] != plain:
            raise ValueError(f"{path}: {name} {raw[name]!r}: heads of a variant removed in "
                             f"#44 (docs/benchmarks.md); only {name} {plain!r} loads")
    return {k: v for k, v in raw.items() if k not in RETIRED}


def read_config(path) -> PrerouterConfig:
    """The config of a prerouter folder, which must hold the heads' weights too."""
    path = Path(path)
    for name in (CONFIG, WEIGHTS):
        if not (path / name).exists():
            raise FileNotFoundError(f"{path / name}: no such file; is {path} a prerouter "
                                    f"folder (python -m edgemoe.train_prerouter --out ...)?")
    raw = json.loads((path / CONFIG).read_text())
    return PrerouterConfig.from_json(current_fields(raw, path / CONFIG))


def heads_adapter(path) -> Optional[Path]:
    """The adapter folder a heads folder carries for its routing (its config's `adapter`),
    or None; a named folder that is missing is a FileNotFoundError naming the field."""
    path = Path(path)
    if not (path / CONFIG).exists():  # (read_config says what the folder lacks)
        return None
    name = json.loads((path / CONFIG).read_text()).get("adapter") or ""
    if not name:
        return None
    found = path / name
    if not (found / "adapter_config.json").exists() or Path(name).is_absolute() \
            or ".." in Path(name).parts:
        raise FileNotFoundError(f"{path / CONFIG}: adapter {name!r}: expected a LoRA folder "
                                f"inside {path}, found none")
    return found
