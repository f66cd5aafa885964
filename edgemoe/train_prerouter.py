"""Train prerouter heads by distillation from the model's own routers.

    python -m edgemoe.train_prerouter --model PATH --data FILE --out DIR
           [--eval-data FILE] [--epochs N] [--seed S] [--same-token]

1. Run the base model with native routing over windows of the text (the last 10% of
   windows held out, or --eval-data) and record, for every MoE layer and token, the
   block's input x, the router's logits and its expert ids: DIR/features/{train,eval}/,
   one .npy memmap per layer and quantity, written window by window (bounded memory).
   Features that exist are reused.
2. Train every head (edgemoe.mlx_backend.prerouter) on them: KL to the native router's distribution
   plus BCE on its top-k set; AdamW. A checkpoint per epoch in DIR/checkpoints/ lets an
   interrupted run resume.
3. Report per-layer top-k recall (|predicted & native| / k) and exact-set accuracy on
   the held-out windows, beside the free baseline (the next layer's router applied to
   the current input) for the next-token and same-token targets: DIR/report.json.
   The heads are in DIR/prerouter/ (load with edgemoe.mlx_backend.prerouter.load_prerouter).

PATH is an mlx-lm checkpoint (loaded fully resident) or an edgemoe pack.
"""

import argparse
import json
import shutil
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from tqdm import tqdm

from .cli import tool, tool_parser
from .format.source import source_kind
from .options import StreamOptions
from .streaming.budget import is_auto
from .mlx_backend.gates import (BlockInput, gate_logits, handing, hidden_size,
                            indices_from_logits, moe_blocks, tapped, uses_sigmoid)
from .routing.heads_config import HEAD_HIDDEN
from .mlx_backend.prerouter import (Prerouter, PrerouterConfig, config_for_model, load_prerouter,
                                save_prerouter)

# knobs
CONTEXT = 256  # tokens per window
HOLDOUT = 0.1  # fraction of windows held out when no --eval-data
BATCH_SIZE = 128
LEARNING_RATE = 1e-3
WEIGHT_DECAY = 0.01
SET_LOSS_WEIGHT = 1.0  # BCE on the native top-k set, beside the KL
FEATURES_VERSION = 1


def load_base(path: str, options: Optional[StreamOptions] = None):
    """The model with native routing: an edgemoe pack streamed under the options' budget,
    an mlx-lm quantized checkpoint streamed in place when a budget is given, or else
    mlx-lm's own model, fully resident."""
    options = StreamOptions.of(options, routing="native", prerouter_path=None,
                               adapter_path=None)
    kind = source_kind(path)
    given = not is_auto(options.expert_budget) and options.expert_budget not in ("1.0", 1.0)
    if kind == "pack" or (kind == "mlx-lm" and given):
        from .mlx_backend.loader import load

        return load(path, options)
    from mlx_lm import load

    return load(path)


def text_windows(tokens: List[int], context: int) -> List[np.ndarray]:
    return [np.array(tokens[i:i + context]) for i in range(0, len(tokens), context)
            if len(tokens[i:i + context]) > 1]


# -- 1. recording ------------------------------------------------------------------

@contextmanager
def block_inputs(blocks: Dict[int, nn.Module]):
    """While active, the yielded function returns what each MoE block's last call saw:
    {layer: (x, logits)}, its input and the logits its router computed, flattened to
    rows; the blocks still route natively."""
    with ExitStack() as stack:
        seen = {}
        for layer, block in blocks.items():
            tap = stack.enter_context(tapped(block))  # records the router's logits
            handed = stack.enter_context(handing(block, BlockInput()))
            seen[layer] = tap, handed

        def last_call():
            return {layer: (handed.x.reshape(-1, handed.x.shape[-1]),
                            tap.recorded.reshape(-1, tap.num_experts))
                    for layer, (tap, handed) in seen.items()}

        yield last_call


def record(model, blocks, windows: List[np.ndarray], folder: Path, key: dict,
           baselines: Dict[int, int], desc: str):
    """Write features of `windows` to `folder`, unless they are there already.

    x_<l>.npy (N, D) float16, logits_<l>.npy (N, E) float32, routed_<l>.npy (N, k)
    int16 for each MoE layer l; pos.npy (N,) the position in its window; and for each
    target t in `baselines` (target -> source), base_<t>.npy: t's router logits applied
    to its source layer's input. Returns True if it recorded, False if they were there.
    """
    meta_path, key = folder / "meta.json", json.loads(json.dumps(key))  # as read back: no tuples
    if meta_path.exists() and json.loads(meta_path.read_text()).get("key") == key:
        return False
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    n = sum(len(w) for w in windows)
    layers = sorted(blocks)
    pos = np.concatenate([np.arange(len(w)) for w in windows]).astype(np.int32)
    np.save(folder / "pos.npy", pos)
    files = {}
    row = 0
    with block_inputs(blocks) as last_call:
        for window in tqdm(windows, desc=desc, unit="window"):
            model(mx.array(window[None]))
            captured = last_call()
            arrays = {}
            for l in layers:
                x, logits = captured[l]
                arrays[f"x_{l}"] = x.astype(mx.float16)
                arrays[f"logits_{l}"] = logits.astype(mx.float32)
                arrays[f"routed_{l}"] = indices_from_logits(blocks[l], logits)
            for t, s in baselines.items():
                arrays[f"base_{t}"] = gate_logits(blocks[t], captured[s][0]).astype(mx.float32)
            mx.eval(arrays)
            for name, a in arrays.items():
                a = np.array(a)
                if name not in files:
                    dtype = np.int16 if name.startswith("routed") else a.dtype
                    files[name] = np.lib.format.open_memmap(
                        folder / f"{name}.npy", mode="w+", dtype=dtype, shape=(n, a.shape[-1]))
                files[name][row:row + len(a)] = a
            row += len(window)
    for f in files.values():
        f.flush()
    meta = {"key": key, "tokens": n, "windows": len(windows), "layers": layers}
    meta_path.write_text(json.dumps(meta))  # last: features without it are incomplete
    return True


class Features:
    """Recorded features of one split, memory-mapped."""

    def __init__(self, folder: Path, layers: List[int], baselines=()):
        def open_(name):
            return np.load(folder / f"{name}.npy", mmap_mode="r")

        self.pos = np.load(folder / "pos.npy")
        self.x = {l: open_(f"x_{l}") for l in layers}
        self.logits = {l: open_(f"logits_{l}") for l in layers}
        self.routed = {l: open_(f"routed_{l}") for l in layers}
        self.base = {t: open_(f"base_{t}") for t in baselines}

    def rows(self, same_token: bool) -> np.ndarray:
        """Tokens with a target: all (same token), or those followed in their window."""
        if same_token:
            return np.arange(len(self.pos))
        return np.flatnonzero(self.followed)

    @property
    def followed(self) -> np.ndarray:
        return np.append(self.pos[1:] == self.pos[:-1] + 1, False)

    def batch(self, config: PrerouterConfig, rows: np.ndarray, targets=None) -> dict:
        """Head inputs and native targets for `rows` (sorted), for every head (or those
        of `targets`): {target: (x, routed now, routed before, native logits, native set)}.
        A head about the next token (config.lead) takes those of `rows` followed."""
        e = config.num_experts
        out = {}
        for t in targets or config.targets:
            s, shift = config.sources[t], config.lead
            r = rows[self.followed[rows]] if shift else rows
            prev = multi_hot_np(self.routed[s][np.maximum(r - 1, 0)], e)  # the token before
            prev[self.pos[r] < 1] = 0  # (none: zeros)
            out[t] = (mx.array(self.x[s][r].astype(np.float32)),
                      mx.array(multi_hot_np(self.routed[s][r], e)), mx.array(prev),
                      mx.array(self.logits[t][r + shift]),
                      mx.array(multi_hot_np(self.routed[t][r + shift], e)))
        return out


def multi_hot_np(ids: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros((len(ids), n), dtype=np.float32)
    np.put_along_axis(out, ids.astype(np.int64), 1.0, axis=1)
    return out


# -- 2. training -------------------------------------------------------------------

def head_loss(logits, native_logits, native_set, sigmoid: bool):
    """Distillation to the native router, plus BCE on the native top-k set."""
    if sigmoid:  # independent per-expert scores: binary cross-entropy to sigmoid(native)
        distill = nn.losses.binary_cross_entropy(logits, mx.sigmoid(native_logits),
                                                 reduction="mean")
    else:  # KL(native || predicted) over the softmax distribution
        p_log = native_logits - mx.logsumexp(native_logits, axis=-1, keepdims=True)
        q_log = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        distill = (mx.exp(p_log) * (p_log - q_log)).sum(axis=-1).mean()
    top_k_set = nn.losses.binary_cross_entropy(logits, native_set, reduction="mean")
    return distill + SET_LOSS_WEIGHT * top_k_set


def train(prerouter: Prerouter, features: Features, epochs: int, seed: int, sigmoid: bool,
          checkpoints: Path, batch_size: int = BATCH_SIZE, lr: float = LEARNING_RATE,
          max_steps: int = 0) -> List[float]:
    optimizer = optim.AdamW(learning_rate=lr, weight_decay=WEIGHT_DECAY)

    def loss_fn(model, batch):
        return sum(head_loss(model.head(t)(x, now, prev), native, top, sigmoid)
                   for t, (x, now, prev, native, top) in batch.items())

    loss_and_grad = nn.value_and_grad(prerouter, loss_fn)
    start, losses = resume(prerouter, optimizer, checkpoints)
    rows = features.rows(prerouter.config.same_token)
    for epoch in range(start, epochs):
        order = np.random.default_rng([seed, epoch]).permutation(rows)
        steps = range(0, len(order), batch_size)
        if max_steps:
            steps = steps[:max_steps]
        total = 0.0
        bar = tqdm(steps, desc=f"epoch {epoch + 1}/{epochs}", unit="step")
        for i in bar:
            batch = features.batch(prerouter.config, np.sort(order[i:i + batch_size]))
            loss, grads = loss_and_grad(prerouter, batch)
            optimizer.update(prerouter, grads)
            mx.eval(prerouter.parameters(), optimizer.state, loss)
            total += loss.item()
            bar.set_postfix(loss=f"{loss.item() / len(batch):.4f}")
        losses.append(total / max(len(steps), 1) / len(prerouter.config.sources))
        save_checkpoint(prerouter, optimizer, checkpoints / f"epoch_{epoch + 1}", losses)
    return losses


def save_checkpoint(prerouter, optimizer, folder: Path, losses):
    save_prerouter(prerouter, folder)
    mx.save_safetensors(str(folder / "optimizer.safetensors"),
                        dict(tree_flatten(optimizer.state)))
    (folder / "losses.json").write_text(json.dumps(losses))


def resume(prerouter, optimizer, checkpoints: Path):
    """Continue after the last epoch checkpointed: (first epoch to run, losses so far)."""
    done = sorted((int(p.name.split("_")[1]), p) for p in checkpoints.glob("epoch_*")
                  if (p / "optimizer.safetensors").exists())
    if not done:
        return 0, []
    epoch, folder = done[-1]
    saved = load_prerouter(folder)
    if saved.config != prerouter.config:
        raise ValueError(f"{folder}: checkpoint of another configuration "
                         f"({saved.config} vs {prerouter.config}); use a fresh --out")
    prerouter.update(saved.parameters())
    optimizer.init(prerouter.trainable_parameters())
    optimizer.state = tree_unflatten(list(mx.load(str(folder / "optimizer.safetensors")).items()))
    print(f"resuming after epoch {epoch} ({folder})")
    return epoch, json.loads((folder / "losses.json").read_text())


# -- 3. evaluation -----------------------------------------------------------------

def agreement(predicted: np.ndarray, native: np.ndarray) -> dict:
    """Mean top-k recall |predicted & native| / k and exact-set accuracy."""
    k = native.shape[-1]
    hits = (predicted[:, :, None] == native[:, None, :]).any(-1).sum(-1)
    return {"recall": float(hits.mean() / k), "exact": float((hits == k).mean()),
            "tokens": int(len(native))}


def evaluate(prerouter: Prerouter, blocks, features: Features, chunk: int = 4096) -> dict:
    config = prerouter.config
    next_rows, all_rows = features.rows(False), features.rows(True)
    layers = []
    for t, s in sorted(config.sources.items()):
        block, shift = blocks[t], config.lead
        head_rows = features.rows(not shift)
        predicted, base = [], []
        for i in range(0, len(head_rows), chunk):
            b = features.batch(config, head_rows[i:i + chunk], [t])[t]
            predicted.append(np.array(indices_from_logits(block, prerouter.head(t)(*b[:3]))))
        for i in range(0, len(all_rows), chunk):
            logits = mx.array(features.base[t][all_rows[i:i + chunk]])
            base.append(np.array(indices_from_logits(block, logits)))
        predicted, base = np.concatenate(predicted), np.concatenate(base)
        routed = np.asarray(features.routed[t]).astype(np.int64)
        layers.append({
            "target": t, "source": s, "next_token": bool(shift),
            "head": agreement(predicted, routed[head_rows + shift]),
            "baseline_same_token": agreement(base, routed),
            "baseline_next_token": agreement(base[next_rows], routed[next_rows + 1]),
            # the target's own routing of the previous token, known a layer later
            "repeat_previous_token": agreement(routed[next_rows], routed[next_rows + 1]),
        })
    return {"variant": "same_token" if config.same_token else "next_token", "layers": layers}


def print_table(report: dict):
    print(f"held-out top-{report['top_k']} recall / exact-set accuracy "
          f"(head: {report['variant']} target)")
    print(f"{'layer':>5} {'head':>15} {'base next-tok':>15} {'base same-tok':>15} "
          f"{'repeat prev':>15}")
    for r in report["layers"]:
        cells = [r[k] for k in ("head", "baseline_next_token", "baseline_same_token",
                                "repeat_previous_token")]
        print(f"{r['target']:>5} " + " ".join(f"{c['recall']:>7.3f} / {c['exact']:.3f}"
                                             for c in cells))


@tool("train_prerouter")
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="mlx-lm checkpoint or edgemoe pack")
    p.add_argument("--data", required=True, help="UTF-8 training text")
    p.add_argument("--eval-data", default=None,
                   help="held-out text (default: the last 10%% of --data's windows)")
    p.add_argument("--out", required=True, help="folder for features, checkpoints, heads")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--same-token", action="store_true",
                   help="predict layer l+1 of the same token (one layer of lead time)")
    p.add_argument("--native-layers", default="",
                   help="comma-separated MoE layers a prerouted mode keeps native "
                        "(the first MoE layer always is)")
    p.add_argument("--context", type=int, default=CONTEXT)
    p.add_argument("--batch-size", type=int, default=BATCH_SIZE)
    p.add_argument("--lr", type=float, default=LEARNING_RATE)
    p.add_argument("--max-steps", type=int, default=0, help="steps per epoch (0: all)")
    p.add_argument("--max-train-tokens", type=int, default=0)
    p.add_argument("--max-eval-tokens", type=int, default=0)
    StreamOptions.add_arguments(p, only=["expert_budget", "cache_policy", "io", "readers"])
    args = tool_parser(p, "train_prerouter").parse_args(argv)
    report = run(args)
    print_table(report)


def run(args) -> dict:
    out = Path(args.out)
    model, tokenizer = load_base(args.model, StreamOptions.from_args(args))
    config_json = json.loads((Path(args.model) / "config.json").read_text())
    blocks = moe_blocks(model)
    native = [int(l) for l in args.native_layers.split(",") if l.strip()]
    mx.random.seed(args.seed)
    config = config_for_model(config_json["model_type"], hidden_size(blocks[min(blocks)]),
                              blocks, args.same_token, native)
    prerouter = Prerouter(config)

    def tokens_of(path, limit):
        text = Path(path).read_text()
        tokens = tokenizer.encode(text)
        return tokens[:limit] if limit else tokens

    train_windows = text_windows(tokens_of(args.data, args.max_train_tokens), args.context)
    if args.eval_data:
        eval_windows = text_windows(tokens_of(args.eval_data, args.max_eval_tokens),
                                    args.context)
    else:
        held = max(1, int(round(len(train_windows) * HOLDOUT)))
        if len(train_windows) < 2:
            raise ValueError(f"{args.data}: too little text for a held-out window")
        train_windows, eval_windows = train_windows[:-held], train_windows[-held:]
        if args.max_eval_tokens:
            eval_windows = text_windows(np.concatenate(eval_windows)[:args.max_eval_tokens]
                                        .tolist(), args.context)
    key = {"version": FEATURES_VERSION, "model": str(Path(args.model).resolve()),
           "data": str(Path(args.data).resolve()), "context": args.context,
           "max_train_tokens": args.max_train_tokens}
    if record(model, blocks, train_windows, out / "features" / "train", key, {},
              "record train") and (out / "checkpoints").exists():
        shutil.rmtree(out / "checkpoints")  # heads of other features: start over
    eval_key = dict(key, eval_data=str(Path(args.eval_data).resolve()) if args.eval_data
                    else None, max_eval_tokens=args.max_eval_tokens,
                    baselines=sorted(config.sources.items()))
    record(model, blocks, eval_windows, out / "features" / "eval", eval_key, config.sources,
           "record eval")
    layers = sorted(blocks)
    train_features = Features(out / "features" / "train", layers)
    eval_features = Features(out / "features" / "eval", layers, config.targets)
    sigmoid = uses_sigmoid(blocks[layers[-1]])
    losses = train(prerouter, train_features, args.epochs, args.seed, sigmoid,
                   out / "checkpoints", args.batch_size, args.lr, args.max_steps)
    save_prerouter(prerouter, out / "prerouter")
    report = evaluate(prerouter, blocks, eval_features)
    report.update(model=args.model, data=args.data, eval_data=args.eval_data,
                  top_k=config.top_k, num_experts=config.num_experts,
                  train_tokens=len(train_features.pos), eval_tokens=len(eval_features.pos),
                  epochs=args.epochs, seed=args.seed, head_hidden=HEAD_HIDDEN,
                  train_loss=losses, heads=str(out / "prerouter"))
    (out / "report.json").write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
