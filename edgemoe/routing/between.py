"""Per-layer fallback (issue #52), written into a heads folder's own config: backend-free,
so every backend reads the result (the MLX side's cache-conditional routing and reduced
top-k are edgemoe.mlx_backend.conditional).

- `with_native_layers`: a copy of a heads folder whose config keeps the given layers on
  their router (PrerouterConfig.native_layers, which every tool reads).
- `route_by_recall` (`python -m edgemoe.routing.between`) chooses them from each layer's
  held-out recall and writes them, with cache-conditional routing for the others, into
  the heads' own config: the bundled pack's is its default of `--routing prerouted`.
- `with_adapter` (`--adapter DIR`): the adapter measured with that routing, written into
  the heads' folder (a subset of DIR: some layers, or their attention only) and named by
  their config, so that the heads load it unless another adapter is given.
- `plain_heads` (`--plain-copy`): heads on every layer but the first, what CUDA runs.
"""

import json
import shutil
from pathlib import Path
from typing import Dict, Iterable, Optional

from ..format.adapters import adapter_subset
from .heads_config import CONFIG

ADAPTER = "adapter"  # the heads' own adapter's folder, inside theirs


def with_native_layers(heads: Path, layers: Iterable[int], out: Path) -> Path:
    """A copy of the heads folder `heads` in `out` whose config keeps `layers` native
    (beside those it keeps already)."""
    heads, out = Path(heads), Path(out)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(heads, out)
    config = json.loads((out / CONFIG).read_text())
    config["native_layers"] = sorted(set(config.get("native_layers", [])) | set(layers))
    (out / CONFIG).write_text(json.dumps(config, indent=1))
    return out


def plain_heads(heads: Path, out: Path) -> Path:
    """A copy of the heads folder `heads` in `out` routed plainly: every layer but the
    first by the heads, at the model's top-k (no per-layer fallback, reduced top-k or
    cache-conditional routing)."""
    out = with_native_layers(heads, [], out)
    config = json.loads((out / CONFIG).read_text())
    if config.get("adapter"):  # measured with the routing this copy leaves
        shutil.rmtree(out / config["adapter"], ignore_errors=True)
    config.update(native_layers=sorted(config["native_layers"])[:1], route_top_k=0,
                  conditional=0, adapter="")
    (out / CONFIG).write_text(json.dumps(config, indent=1))
    return out


def route_by_recall(heads: Path, min_recall: float, conditional: int) -> dict:
    """Set the heads folder's own routing (its prerouter_config.json, what `--routing
    prerouted` runs): the layers whose head recalls less than `min_recall` of the top-k on
    held-out text (its training report) keep their router; the others route
    cache-conditionally among the slots and the heads' `conditional` most likely (0:
    by the heads). Returns the config written."""
    heads = Path(heads)
    recall = layer_recall(heads / "report.json")
    if recall is None:
        raise FileNotFoundError(f"{heads / 'report.json'}: no such file; the heads' "
                                f"training report gives each layer's recall")
    config = json.loads((heads / CONFIG).read_text())
    first = sorted(set(config["native_layers"]))[:1]
    config["native_layers"] = sorted({*first, *(t for t, r in recall.items() if r < min_recall)})
    config["conditional"] = int(conditional)
    (heads / CONFIG).write_text(json.dumps(config, indent=1) + "\n")
    return config


def with_adapter(heads: Path, adapter: Path, layers: str, attention_only: bool) -> dict:
    """Give the heads folder `heads` its own adapter: `adapter`'s tensors of the MoE
    layers `layers` ("predicted": those its config routes by the heads; "all"), their
    attention only with `attention_only`, written to heads/ADAPTER and named by its
    config. Returns the config written."""
    heads = Path(heads)
    config = json.loads((heads / CONFIG).read_text())
    if layers not in ("predicted", "all"):
        raise ValueError(f"--adapter-layers: expected predicted or all, found {layers!r}")
    native = set(config.get("native_layers", []))
    moe = sorted({int(t) for t in config["sources"]} | set(config["sources"].values()))
    chosen = moe if layers == "all" else [l for l in moe if l not in native]
    adapter_subset(adapter, heads / ADAPTER, chosen, attention_only)
    config["adapter"] = ADAPTER
    (heads / CONFIG).write_text(json.dumps(config, indent=1) + "\n")
    return config


def main(argv=None):
    import argparse

    p = argparse.ArgumentParser(description="Set a heads folder's routing from its layers' "
                                            "recall (route_by_recall)")
    p.add_argument("--heads", required=True, help="a prerouter heads folder")
    p.add_argument("--min-recall", type=float,
                   help="layers whose head recalls less keep their router (0.45)")
    p.add_argument("--conditional", type=int, default=0,
                   help="the others: the router among the slots and the heads' m most "
                        "likely (8); 0: routed by the heads")
    p.add_argument("--plain-copy", metavar="OUT",
                   help="instead, copy the heads to OUT routed plainly (every layer but "
                        "the first by the heads: the routing the CUDA backend runs)")
    p.add_argument("--adapter", metavar="DIR",
                   help="instead, give the heads their own adapter: DIR's tensors of "
                        "--adapter-layers, loaded with the heads unless another is given")
    p.add_argument("--adapter-layers", default="predicted", choices=("predicted", "all"),
                   help="the MoE layers the heads' adapter keeps (predicted: those routed "
                        "by the heads)")
    p.add_argument("--attention-only", action="store_true",
                   help="keep the adapter's attention only: no expert deltas, no bytes "
                        "added to a read")
    args = p.parse_args(argv)
    if args.adapter:
        config = with_adapter(Path(args.heads), Path(args.adapter), args.adapter_layers,
                              args.attention_only)
        print(f"{args.heads}: adapter {Path(args.heads) / config['adapter']}")
        return
    if args.plain_copy:
        print(plain_heads(Path(args.heads), Path(args.plain_copy)))
        return
    if args.min_recall is None:
        p.error("--min-recall: expected a recall (0.45), found none")
    config = route_by_recall(Path(args.heads), args.min_recall, args.conditional)
    print(f"{args.heads}: native layers {config['native_layers']}, conditional "
          f"{config['conditional']}")


def layer_recall(report_path: Path) -> Optional[Dict[int, float]]:
    """Each target layer's held-out recall from a train_prerouter report.json."""
    path = Path(report_path)
    if not path.exists():
        return None
    report = json.loads(path.read_text())
    return {r["target"]: r["head"]["recall"] for r in report["layers"]}


if __name__ == "__main__":
    main()
