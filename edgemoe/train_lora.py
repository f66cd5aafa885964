"""Distil a recovery LoRA from the unquantized model into the int4 pack.

    python -m edgemoe.train_lora --model PACK --teacher HF_DIR --data FILE --out DIR
           [--eval-data FILE] [--routing prerouted] [--prerouter DIR] [--rank 8]
           [--scale 20] [--experts] [--steps 200] [--batch-size 4] [--context 256]
           [--lr 5e-5] [--seed 0]

Teacher: the unquantized checkpoint, fully resident (`mlx_lm.load`), native routing; or
an edgemoe pack (the student's own, say), all experts resident, native routing.
Student: the int4 pack (`edgemoe.load`) with the chosen routing, prerouted by default;
its prerouter heads stay frozen (they belong to the expert store, not to the model's
parameters). The student gets zero-initialised LoRA deltas on its resident linear
layers (edgemoe.mlx_backend.lora) and learns them by minimising KL(teacher || student) between the
next-token distributions, with AdamW on windows drawn by a seeded generator.

With --experts the routed experts get a delta each too (mlx-lm's LoRASwitchLinear keys);
served, those stream with their experts (edgemoe.format.deltas writes their records).

DIR holds the adapter in mlx-lm's format (adapters.safetensors, adapter_config.json), so
it serves unmerged with `edgemoe.load(PACK, adapter_path=DIR)` or `--adapter-path DIR`,
and DIR/train_state/ (optimizer, step, generator) every --save-every steps: a rerun with
the same DIR resumes. DIR/report.json holds held-out perplexity, top-1 agreement and KL
to the teacher before and after training, and the merging experiment (edgemoe.mlx_backend.lora):
how much of the adapter's effect survives merging into the weights and re-quantizing.
"""

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from tqdm import tqdm

from .cli import tool, tool_parser
from .eval import compare
from .format.deltas import expert_deltas
from .format.source import NO_ADAPTER, open_source
from .mlx_backend.families import find_experts
from .mlx_backend.loader import load
from .options import StreamOptions
from .routing.modes import PREROUTED
from .mlx_backend.lora import (ADAPTER_CONFIG, apply_lora, default_targets, expert_targets,
                         merge_adapter, merge_survival, save_adapter)

STATE = "train_state"
TORCH_STATE = "train_state_torch"  # edgemoe.cuda.train's
REPORT = "report.json"
MERGE_WINDOWS = 4  # held-out windows the merged effect is measured on


def kd_loss(student, inputs: mx.array, teacher_logp: mx.array) -> mx.array:
    """Mean over tokens of KL(teacher || student)."""
    logits = student(inputs).astype(mx.float32)
    student_logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return (mx.exp(teacher_logp) * (teacher_logp - student_logp)).sum(-1).mean()


def teacher_log_probs(teacher, inputs: mx.array) -> mx.array:
    logits = teacher(inputs).astype(mx.float32)
    return mx.stop_gradient(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def load_student(args, adapter_path=None):
    """The student; without `adapter_path` bare (not even the heads' own adapter)."""
    return load(args.model, StreamOptions.from_args(args,
                                                    adapter_path=adapter_path or NO_ADAPTER))


def quality(teacher, student, tokens, args, desc) -> dict:
    """Student vs teacher on the held-out tokens."""
    scores = compare([teacher, student], tokens, args.context, desc=desc)
    return {"teacher_perplexity": scores["perplexity"][0],
            "perplexity": scores["perplexity"][1],
            "top1_agreement": scores["top1_agreement"],
            "kl_to_teacher": scores["mean_kl"], "tokens": scores["tokens"]}


class TrainState:
    """What a resumed run needs besides the adapter: optimizer state, step, generator."""

    def __init__(self, out: Path, seed: int):
        self.dir = out / STATE
        self.step, self.losses, self.before = 0, [], None
        self.rng = np.random.default_rng(seed)

    def save(self, model, optimizer, config):
        save_adapter(model, config, self.dir.parent)  # the adapter as mlx-lm writes it
        tmp = self.dir.with_name(self.dir.name + ".partial")
        tmp.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(optimizer.state)))
        (tmp / "state.json").write_text(json.dumps(
            {"step": self.step, "losses": self.losses, "before": self.before,
             "rng": self.rng.bit_generator.state}))
        if self.dir.exists():
            for f in self.dir.iterdir():
                f.unlink()
            self.dir.rmdir()
        tmp.rename(self.dir)

    def restore(self, model, optimizer) -> bool:
        if not (self.dir / "state.json").exists():
            return False
        state = json.loads((self.dir / "state.json").read_text())
        self.step, self.losses, self.before = state["step"], state["losses"], state["before"]
        self.rng.bit_generator.state = state["rng"]
        model.load_weights(str(self.dir.parent / "adapters.safetensors"), strict=False)
        optimizer.state = tree_unflatten(list(mx.load(str(self.dir / "optimizer.safetensors")).items()))
        return True


def batches(tokens: np.ndarray, args, rng):
    starts = rng.integers(0, len(tokens) - args.context - 1, size=args.batch_size)
    window = np.stack([tokens[s:s + args.context + 1] for s in starts])
    return mx.array(window[:, :-1])


def split_text(args):
    """Training and held-out text: --eval-data, or the last tenth of --data."""
    text = Path(args.data).read_text()
    if args.eval_data:
        return text, Path(args.eval_data).read_text()
    cut = len(text) * 9 // 10
    return text[:cut], text[cut:]


def train(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mx.random.seed(args.seed)  # LoRA's A matrices
    teacher, _ = _load_teacher(args.teacher)
    student, tokenizer = load_student(args)
    config = apply_lora(student, **lora_arguments(args, student))
    train_text, eval_text = split_text(args)
    train_tokens = np.array(tokenizer.encode(train_text))
    eval_tokens = tokenizer.encode(eval_text)[:args.eval_tokens + 1]
    if len(train_tokens) <= args.context + 1:
        raise ValueError(f"{args.data}: {len(train_tokens)} tokens, fewer than one window")
    def measure_before():
        return quality(teacher, student, eval_tokens, args, "before")

    if args.backend == "torch":
        from .cuda.train import distil  # (torch: the cuda or test extra)
        run = distil(args, out, config, train_tokens, batches, measure_before)
        losses, before = run["losses"], run["before"]
        student, _ = load_student(args, adapter_path=out)  # as it is served
    else:
        losses, before = distil_mlx(args, out, teacher, student, config, train_tokens,
                                    measure_before)
    if args.experts:  # the experts' deltas as records, to stream with them when served
        expert_deltas(out, open_source(args.model, find_experts=find_experts))
    after = quality(teacher, student, eval_tokens, args, "after")
    report = {"model": args.model, "teacher": args.teacher, "routing": str(args.routing),
              "prerouter": args.prerouter_path, "lora": config["lora_parameters"],
              "steps": args.steps, "batch_size": args.batch_size, "context": args.context,
              "lr": args.lr, "seed": args.seed, "train_tokens_seen": args.steps * args.batch_size * args.context,
              "backend": args.backend,
              "loss_first_10": float(np.mean(losses[:10])),
              "loss_last_10": float(np.mean(losses[-10:])),
              "before": before, "after": after}
    report["merged"] = merge_experiment(args, teacher, student, eval_tokens)
    (out / REPORT).write_text(json.dumps(report, indent=1))
    return report


def distil_mlx(args, out, teacher, student, config, train_tokens, before):
    """The MLX loop: (losses, the student's quality before)."""
    schedule = optim.cosine_decay(args.lr, args.steps, args.lr * 0.1)
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=0.0)
    state = TrainState(out, args.seed)
    if state.restore(student, optimizer):
        print(f"resumed from {state.dir}: step {state.step}")
    if state.before is None:
        state.before = before()
        state.save(student, optimizer, config)
    loss_and_grad = nn.value_and_grad(student, kd_loss)
    bar = tqdm(total=args.steps, initial=state.step, desc="distil", unit="step")
    while state.step < args.steps:
        inputs = batches(train_tokens, args, state.rng)
        target = teacher_log_probs(teacher, inputs)
        loss, grads = loss_and_grad(student, inputs, target)
        optimizer.update(student, grads)
        mx.eval(loss, student.trainable_parameters(), optimizer.state)
        state.step += 1
        state.losses.append(loss.item())
        bar.update(1)
        bar.set_postfix(kl=f"{np.mean(state.losses[-10:]):.4f}")
        if state.step % args.save_every == 0 or state.step == args.steps:
            state.save(student, optimizer, config)
    bar.close()
    return state.losses, state.before


def merge_experiment(args, teacher, student, eval_tokens) -> dict:
    """Merge the trained adapter into the int4 weights, re-quantize, and measure what
    survives: at every adapted projection's output, and at the output log-probs. The
    routed experts' deltas stay unmerged (merging them would rewrite every record)."""
    base, _ = load_student(args)
    merged, _ = load_student(args, adapter_path=args.out)
    merge_adapter(merged)
    count = max(1, min(MERGE_WINDOWS, len(eval_tokens) // args.context))
    windows = np.array(eval_tokens[:count * args.context]).reshape(count, -1)
    result = merge_survival(student, base, merged, mx.array(windows))
    result["quality"] = quality(teacher, merged, eval_tokens, args, "merged")
    # re-quantizing is not lossless by itself: the same round trip with a zero delta
    requantized, _ = load_student(args)
    apply_lora(requantized, **lora_arguments(args, requantized))
    merge_adapter(requantized)
    result["requantized_without_adapter"] = quality(teacher, requantized, eval_tokens, args,
                                                    "requantized")
    return result


def lora_arguments(args, model) -> dict:
    targets = args.targets.split(",") if args.targets else default_targets(model)
    if args.experts:
        targets = targets + expert_targets(model)
    return {"rank": args.rank, "scale": args.scale, "targets": targets}


def _load_teacher(path):
    """An edgemoe pack teaches as int4 native routing, every expert resident: the LoRA
    then recovers what the student's routing loses, not what int4 loses too."""
    if (Path(path) / "manifest.json").exists():
        return load(path, expert_budget=1.0, routing="native")
    from mlx_lm import load as mlx_lm_load

    return mlx_lm_load(path)


def report_lines(report: dict) -> list:
    lines = []
    m = report["merged"]
    rows = [("int4 " + report["routing"], report["before"]),
            ("int4 " + report["routing"] + " + LoRA (unmerged)", report["after"]),
            ("int4 " + report["routing"] + " + LoRA merged, re-quantized", m["quality"]),
            ("int4 " + report["routing"] + ", re-quantized without an adapter",
             m["requantized_without_adapter"])]
    lines.append(f"teacher perplexity {report['before']['teacher_perplexity']:.3f} "
                 f"over {report['before']['tokens']} held-out tokens")
    for name, q in rows:
        lines.append(f"{name}: perplexity {q['perplexity']:.3f}, top-1 agreement "
                     f"{q['top1_agreement']:.2%}, KL {q['kl_to_teacher']:.4f} nats/token")
    lines.append(f"merged and re-quantized: {m['projection_survival']:.0%} of the adapter's "
                 f"effect survives at {m['projection']}'s output (median over projections "
                 f"{m['projection_survival_median']:.0%}), {m['logit_survival']:.0%} at the "
                 f"log-probs")
    return lines


@tool("train_lora")
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="the int4 edgemoe pack (the student)")
    p.add_argument("--teacher", required=True,
                   help="the unquantized checkpoint, or a pack (int4 native routing)")
    p.add_argument("--data", required=True, help="UTF-8 training text")
    p.add_argument("--eval-data", default=None,
                   help="UTF-8 held-out text (default: the last tenth of --data)")
    p.add_argument("--out", required=True, help="adapter folder (resumes if it has one)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--scale", type=float, default=20.0)
    p.add_argument("--targets", default=None,
                   help="comma-separated module paths within a decoder layer "
                        "(default: every resident linear layer but the router)")
    p.add_argument("--experts", action="store_true",
                   help="adapt the routed experts too: a delta per expert, streamed with it")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--eval-tokens", type=int, default=8192)
    p.add_argument("--backend", choices=("mlx", "torch"), default="mlx",
                   help="what trains: MLX, or PyTorch on the CPU (2.2 s a step of 1,024 "
                        "tokens of the bundled model with its experts' deltas here, with "
                        "the cores to itself; needs torch and transformers: the cuda extra)")
    StreamOptions.add_arguments(p, only=["expert_budget", "cache_policy", "io", "routing",
                                         "prerouter_path", "readers"])
    p.set_defaults(routing=PREROUTED)  # the student as it will be served
    args = tool_parser(p, "train_lora").parse_args(argv)
    existing = Path(args.out) / ADAPTER_CONFIG
    resumable = (Path(args.out) / STATE).exists() or (Path(args.out) / TORCH_STATE).exists()
    if existing.exists() and not resumable:
        sys.exit(f"edgemoe.train_lora: error: {args.out} holds an adapter that is not a "
                 f"resumable run; choose another --out")
    report = train(args)
    print("\n".join(report_lines(report)))


if __name__ == "__main__":
    main()
