"""The bundled model's agent stage: a last training stage that gives it a 32K context and
teaches it to end a chat turn.

It starts from the shipped int4 pack, dequantized to float32 (the unquantized weights are
not kept), raises RoPE's base frequency (`rope_theta`, the "adjusted base frequency" of
Code Llama and Qwen: mlx-lm honours it, and ignores `rope_scaling` for qwen3_moe, so the
context grows by the weights and the base alone), and trains on a mix of
- long windows (LONG tokens) of the training corpus, its files concatenated in order, so
  that attention learns to use the new positions; 32K itself is left to the base's
  generalisation (measured by scripts/eval_agent_model.py), as 32K-token steps are too
  slow for 2 CPU cores;
- short chat turns in the pack's ChatML whose replies end with <|im_end|>
  (scripts/agent_chat_data.py builds them from the corpus and man's index), packed into
  windows of CHAT_WINDOW tokens,
- with `--short-every N`, short windows (SHORT tokens, the first stage's length, SHORT_BATCH
  of them) of the corpus as every N-th corpus step: the new base moves every position, so
  the first stage's own length is trained again beside the long ones; with `--distil`,
  toward the pack's own next-token distributions there (the pack at its own base, as int4
  stores it: a teacher of what short windows should give),
at a low learning rate, with the per-layer load-balancing loss of the first stage, so that
short-context quality and routing stay as they were. The config it writes says the new
context (max_position_embeddings) and ends generation at <|im_end|> as well as
<|endoftext|> (eos_token_id as a list, which mlx-lm and the server honour).

Outputs under --out RUN: hf/ (the model for `scripts/rebuild_reference.sh RUN pack`),
ckpt/last.pt (a rerun resumes from it), train_log.jsonl, and train.txt / heldout*.txt
copied from the corpus for the heads and traces steps of rebuild_reference.sh.

    python scripts/agent_chat_data.py --corpus CORPUS --out RUN
    python scripts/train_agent_stage.py --pack edgemoe/models/fine --corpus CORPUS --out RUN --steps 300
"""

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_reference_moe as first  # noqa: E402  (the first stage's model, loss, saving)

ROPE_THETA = 1_000_000.0    # NTK-style: 10,000 x (32K / 512 trained)^(d/(d-2)) ~ 850K, rounded up as Qwen's
CONTEXT = 32768             # the context the config states
LONG = 4096                 # tokens of a long window
CHAT_WINDOW = 1024          # tokens of a window of packed chat turns
CHAT_BATCH = 2              # chat windows per chat step
CHAT_EVERY = 2              # every CHAT_EVERY-th step is a chat step
SHORT = 512                 # tokens of a short window (--short-every): the first stage's
SHORT_BATCH = 8             # short windows a short step: a long step's tokens
MAX_CHAT_TURNS = 20000      # more than a stage sees
LR = 2e-4
MIN_LR_FRAC = 0.1
WARMUP = 10
SEED = 2355
CKPT_EVERY_S = 300
IM_END = "<|im_end|>"


def load_pack(pack: Path, rope_theta: float, context: int):
    """transformers' Qwen3-MoE holding the int4 pack's weights dequantized to float32,
    with `rope_theta` and `context` in its config."""
    from transformers import PreTrainedTokenizerFast, Qwen3MoeForCausalLM
    from edgemoe.cuda.model import resident_state_dict
    from edgemoe.cuda.train import expert_weights
    from edgemoe.format.pack import Pack

    tok = PreTrainedTokenizerFast.from_pretrained(pack)
    tok.model_max_length = context  # (the first stage's 512 warned on every long prompt)
    config = json.loads((pack / "config.json").read_text())
    hf_config = first.make_config(tok, first.SHAPES["fine"])
    hf_config.rope_parameters = {"rope_type": "default", "rope_theta": rope_theta}
    hf_config.max_position_embeddings = context
    hf_config.eos_token_id = [tok.convert_tokens_to_ids(t) for t in (first.EOT, IM_END)]
    model = Qwen3MoeForCausalLM(hf_config)
    source = Pack.open(pack)
    state = resident_state_dict(pack / "model.safetensors", config["quantization"], torch.float32,
                                "cpu", skip=tuple(f"{l.module}." for l in source.layers))
    for layer in source.layers:
        w = expert_weights(source, layer)
        block = layer.module.rsplit(".", 1)[0]  # model.layers.i.mlp
        state[f"{block}.experts.gate_up_proj"] = torch.cat([w["gate_proj"], w["up_proj"]], 1)
        state[f"{block}.experts.down_proj"] = w["down_proj"]
    model.load_state_dict(state, strict=True)
    model.generation_config.eos_token_id = hf_config.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.bos_token_id = None
    return model, tok


def affine_quantized(w, bits: int, group: int = 64):
    """`w` quantized and dequantized as MLX's affine quantization does (mx.quantize: the
    group's edge of larger magnitude exact), so that training sees the int4 pack's weights."""
    shape, n_bins = w.shape, 2 ** bits - 1
    g = w.reshape(-1, group)
    w_max, w_min = g.amax(-1, keepdim=True), g.amin(-1, keepdim=True)
    neg = w_min.abs() > w_max.abs()
    scales = ((w_max - w_min) / n_bins).clamp_min(1e-7)
    scales = torch.where(neg, scales, -scales)
    edge = torch.where(neg, w_min, w_max)
    q0 = torch.round(edge / scales)
    scales = torch.where(q0 != 0, edge / torch.where(q0 != 0, q0, 1), scales)
    biases = torch.where(q0 == 0, 0.0, edge)
    q = torch.clamp(torch.round((g - biases) / scales), 0, n_bins)
    return (q * scales + biases).reshape(shape)


def quantized_params(model, config: dict):
    """(parameter, bits) of every weight the pack stores quantized: its linears, embeddings
    and experts at the pack's bits, the routers at theirs (8)."""
    q = config["quantization"]
    out = []
    for name, p in model.named_parameters():
        if p.dim() < 2:
            continue  # norms
        module = name.rsplit(".", 1)[0].replace(".experts.gate_up_proj", ".switch_mlp") \
            .replace(".experts.down_proj", ".switch_mlp")
        out.append((p, q.get(module, q)["bits"]))
    return out


class FakeQuant:
    """Quantization-aware steps (straight-through): the forward and backward run on the
    weights as int4 stores them, the update goes to the float weights. Without it the
    stage's updates, mostly under half a quantization step, round back away at convert."""

    def __init__(self, params):
        self.params, self.latent = params, None

    def __enter__(self):
        self.latent = [p.data for p, _ in self.params]
        for p, bits in self.params:
            p.data = affine_quantized(p.data, bits)

    def __exit__(self, *exc):
        for (p, _), latent in zip(self.params, self.latent):
            p.data = latent


def token_stream(tok, texts, cache: Path):
    """The texts tokenized and joined by <|endoftext|>, as the first stage did."""
    return first.tokenize_docs(tok, texts, cache)


def chat_stream(tok, path: Path, cache: Path):
    """Every chat turn rendered by the pack's template, joined by <|endoftext|>."""
    if cache.exists():
        return np.load(cache)
    eot = tok.convert_tokens_to_ids(first.EOT)
    ids = []
    for line in open(path).readlines()[:MAX_CHAT_TURNS]:
        turn = json.loads(line)  # rendered and encoded as the server does
        text = tok.apply_chat_template(turn["messages"], tools=turn["tools"], tokenize=False)
        ids += tok.encode(text, add_special_tokens=False) + [eot]
    arr = np.asarray(ids, dtype=np.uint16)
    np.save(cache, arr)
    return arr


def distillation_loss(logits, teacher, x):
    """KL(teacher || student) per token, the teacher's distributions over `x` (the LoRA
    distillation's loss: edgemoe.cuda.train.kd_loss)."""
    from edgemoe.cuda.train import kd_loss

    with torch.no_grad():
        target = torch.log_softmax(teacher(input_ids=x).logits.float(), -1)
    return kd_loss(logits, target)


def lr_at(step, steps, peak=LR):
    if step < WARMUP:
        return peak * (step + 1) / WARMUP
    progress = (step - WARMUP) / max(steps - WARMUP, 1)
    return peak * (MIN_LR_FRAC + (1 - MIN_LR_FRAC) * 0.5 * (1 + math.cos(math.pi * progress)))


def step_kind(step, short_every=0) -> str:
    """"chat" every CHAT_EVERY-th step; of the corpus steps, "short" every `short_every`-th,
    else "long"."""
    if step % CHAT_EVERY == CHAT_EVERY - 1:
        return "chat"
    corpus_step = step // CHAT_EVERY
    return "short" if short_every and corpus_step % short_every == short_every - 1 else "long"


def batch_at(step, rng, long_ids, chat_ids, long, short_every=0):
    """A chat step (CHAT_BATCH packed windows), a short step (SHORT_BATCH windows of SHORT)
    or a long step (one window of `long`): `step_kind`'s."""
    ids, width, n = {"chat": (chat_ids, CHAT_WINDOW, CHAT_BATCH),
                     "short": (long_ids, SHORT, SHORT_BATCH),
                     "long": (long_ids, long, 1)}[step_kind(step, short_every)]
    starts = rng.integers(0, len(ids) - width, size=n)
    return torch.from_numpy(np.stack([ids[s:s + width] for s in starts]).astype(np.int64))


def save(model, tok, opt, step, rng, out: Path, log):
    ckpt = out / "ckpt" / "last.pt"
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    torch.save(dict(model=model.state_dict(), optimizer=opt.state_dict(), step=step,
                    np_rng=rng.bit_generator.state, torch_rng=torch.get_rng_state()),
               ckpt.with_suffix(".tmp"))
    os.replace(ckpt.with_suffix(".tmp"), ckpt)
    first.save_hf(model, tok, out / "hf")
    log(event="save", step=step)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pack", type=Path, required=True, help="the pack to start from")
    ap.add_argument("--corpus", type=Path, required=True, help="a first-stage run folder (corpus.json)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--rope-theta", type=float, default=ROPE_THETA)
    ap.add_argument("--long", type=int, default=LONG, help="tokens of a long window")
    ap.add_argument("--init", type=Path, default=None,
                    help="start from this run's ckpt/last.pt weights (a QAT phase after a stage)")
    ap.add_argument("--qat", action="store_true",
                    help="train on the weights as the int4 pack will store them (straight-through)")
    ap.add_argument("--threads", type=int, default=1, help="1 is faster when other work shares the cores")
    ap.add_argument("--lr", type=float, default=LR, help="peak learning rate (cosine to a tenth)")
    ap.add_argument("--short-every", type=int, default=0,
                    help="every N-th corpus step trains SHORT-token windows (0: none)")
    ap.add_argument("--distil", action="store_true",
                    help="short steps learn the pack's own distributions (KL), not the text")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    for name in ("train.txt", "heldout.txt", *(p.name for p in args.corpus.glob("heldout_*.txt"))):
        if not (out / name).exists():
            shutil.copy(args.corpus / name, out / name)
    if not (out / "chat_train.jsonl").exists():
        sys.exit(f"{out}/chat_train.jsonl: expected the chat turns (scripts/agent_chat_data.py --out {out})")

    model, tok = load_pack(args.pack, args.rope_theta, CONTEXT)
    teacher = None
    if args.distil:  # the pack as it is: its own base and context, int4 weights, frozen
        pack_config = json.loads((args.pack / "config.json").read_text())
        teacher, _ = load_pack(args.pack, pack_config["rope_theta"],
                               pack_config["max_position_embeddings"])
        teacher.eval().requires_grad_(False)
    corpus = json.loads((args.corpus / "corpus.json").read_text())
    long_ids = token_stream(tok, [t for d in corpus.values() for t in d["train"]], out / "train_ids.npy")
    del corpus
    chat_ids = chat_stream(tok, out / "chat_train.jsonl", out / "chat_ids.npy")
    print(f"tokens: corpus {len(long_ids):,}, chat {len(chat_ids):,}", flush=True)

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": first.WEIGHT_DECAY},
                             {"params": no_decay, "weight_decay": 0.0}], lr=LR, betas=first.BETAS)
    rng = np.random.default_rng(SEED)
    step = 0
    ckpt = out / "ckpt" / "last.pt"
    if ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
        rng.bit_generator.state = state["np_rng"]
        torch.set_rng_state(state["torch_rng"])
        print(f"resumed from {ckpt} at step {step}", flush=True)
    elif args.init is not None:
        model.load_state_dict(torch.load(args.init / "ckpt" / "last.pt", map_location="cpu",
                                         weights_only=False)["model"])
        print(f"weights from {args.init}", flush=True)
    logf = open(out / "train_log.jsonl", "a")

    def log(**kw):
        kw["time"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        logf.write(json.dumps(kw) + "\n")
        logf.flush()

    log(event="start", step=step, steps=args.steps, rope_theta=args.rope_theta, long=args.long,
        short_every=args.short_every, distil=args.distil, qat=args.qat, init=str(args.init),
        chat_window=CHAT_WINDOW, lr=args.lr, chat_tokens=int(len(chat_ids)))
    model.train()
    shape = first.SHAPES["fine"]
    fake_quant = FakeQuant(quantized_params(model, json.loads((args.pack / "config.json").read_text())))
    t0, last_save = time.time(), time.time()
    while step < args.steps:
        lr = lr_at(step, args.steps, args.lr)
        for g in opt.param_groups:
            g["lr"] = lr
        x = batch_at(step, rng, long_ids, chat_ids, args.long, args.short_every)
        kind = step_kind(step, args.short_every)  # (not told by the width: --long may be any)
        with fake_quant if args.qat else contextlib.nullcontext():
            outp = model(input_ids=x, labels=x)
            balance = first.balance_loss(outp, shape)
            loss = outp.loss
            if teacher is not None and kind == "short":
                loss = distillation_loss(outp.logits, teacher, x)
            (loss + balance).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), first.GRAD_CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        log(event="train", step=step, kind=kind, ce=outp.loss.item(), loss=loss.item(), lr=lr)
        print(f"step {step}/{args.steps} {kind} ce {outp.loss.item():.3f} lr {lr:.2e} "
              f"{time.time() - t0:.0f}s this run", flush=True)
        if time.time() - last_save >= CKPT_EVERY_S:
            save(model, tok, opt, step, rng, out, log)
            last_save = time.time()
    save(model, tok, opt, step, rng, out, log)
    log(event="end", step=step)


if __name__ == "__main__":
    main()
