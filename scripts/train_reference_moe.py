"""Train a small reference Qwen3-MoE language model from scratch on CPython's own source code.

Corpus: every `.py` file under `sysconfig.get_paths()['stdlib']` of the interpreter running this
script, excluding any path with a directory component `test`, `tests`, `idlelib` or
`site-packages` (this also drops `lib2to3/tests`). Files are sorted by their path relative to the
stdlib folder and read as UTF-8 (undecodable bytes replaced).
Held-out split: by FILE. The file with sorted index i is held out iff i % HELDOUT_EVERY == 0
(1 file in 20); training never sees those files. The held-out files are written, in order,
joined by a blank line, to OUT/heldout.txt; the train files likewise to OUT/train.txt (the
prerouter heads and the recovery LoRA train on it), and a small sample to OUT/train_sample.txt.
Train documents are tokenized one file at a time and concatenated with `<|endoftext|>` between
files; held-out loss is measured on EVAL_WINDOWS fixed, evenly spaced
windows of the held-out token stream built the same way.

Tokenizer: byte-level BPE (vocab VOCAB_SIZE) trained with `tokenizers` on the train split only,
wrapped in transformers.PreTrainedTokenizerFast (eos = pad = `<|endoftext|>`, no bos) with a
ChatML chat template, saved to OUT/hf.

Model: transformers Qwen3MoeForCausalLM, fp32, all layers MoE, UNTIED embeddings / lm_head,
load-balancing aux loss in the loss. Trained with PyTorch on CPU: on the 2-core x86 build box
PyTorch (transformers' grouped_mm experts) measured ~1800 train tokens/s for this shape
(batch 8x256) vs ~115 tokens/s for mlx-lm's qwen3_moe Model + mlx.optimizers.AdamW on MLX CPU
(its float matmul is a slow reference BLAS there). `--bench` re-measures both.

Outputs under --out DIR: hf/ (Hugging Face layout: safetensors shards of <=20MB, config.json
patched so mlx-lm can load it, tokenizer), ckpt/last.pt (model + optimizer + step + RNG state;
a rerun with the same --out resumes from it), train_log.jsonl, heldout.txt, train.txt,
train_sample.txt.
The LR schedule (linear warmup, cosine decay to LR*MIN_LR_FRAC) runs on training wall time, so
that it ends when the --minutes budget (counted from script start) runs out; or, with --steps N,
on the step count, so that a rerun on the same machine reproduces the same weights (the teacher
of the recovery LoRA, which is too large for git, is rebuilt this way).

    python scripts/train_reference_moe.py --out runs/reference --steps 900

`--shape fine` trains the fine-grained reference instead, the bundled model (edgemoe/models/fine):
8 layers of 128 experts of width 64, top-8 (Qwen3-30B-A3B's routing shape; the same active
expert width per token as the default shape's 2 x 256), with a per-layer load-balancing loss,
on four domains read from this machine, each split by file as above and thinned to about
DOMAIN_CHARS: the standard library,
the Python documentation's reStructuredText (Debian's python3-doc), the manual pages
(rendered by man), and SOURCE_PACKAGES' sources; its tokenizer is the bundled model's
(first trained with the default shape, as above).

    python scripts/train_reference_moe.py --shape fine --out runs/fine --steps 1000 --threads 1

`--draft` trains the bundled model's speculative draft instead: a small dense Qwen3 (mlx-lm's
`qwen3`; DRAFT_* shape, tied embeddings) on the same corpus, split and schedule, with the
tokenizer read from `--tokenizer` (the bundled pack's), so that its tokens are the target's.

    python scripts/train_reference_moe.py --draft --shape fine --tokenizer edgemoe/models/fine \
        --out runs/draft --steps 1000
"""

import argparse
import json
import math
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

# ---------------------------------------------------------------- knobs
SEED = 1337
HELDOUT_EVERY = 20          # file i (sorted) is held out iff i % HELDOUT_EVERY == 0
VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
AUX_LOSS_COEF = 0.01        # load balancing (the reference shape's; a shape may set its own)
# model (Qwen3-MoE shape); --shape picks one
HIDDEN = 256
HEADS = 8
KV_HEADS = 4
HEAD_DIM = 32
SHAPES = {
    # the coarse reference (bundled before the fine one): 32 experts, top-2
    # balanced as transformers does, over all layers' selections together (per-layer skew stays)
    "reference": dict(layers=6, experts=32, top_k=2, expert_width=256, max_params=45_500_000,
                      balance="global", balance_coef=AUX_LOSS_COEF, domains=("stdlib",)),
    # fine-grained as Qwen3-30B-A3B (128/top-8): the same active expert width per token
    # (8 x 64 = 2 x 256), trained on mixed domains so that experts can specialise
    # balanced per layer, as Switch and the real fine-grained models are, so that no layer's
    # routing collapses onto a few experts. The coefficient sets how real the routing looks
    # (held-out, teacher-forced; Qwen3-30B-A3B: 90% of selections on 45-51% of the experts,
    # next-token overlap 0.45): at 0.01, step 155 of 1000 had 33-41% and 0.26-0.38; at 0.03,
    # the full run had 77-83% and 0.11-0.24, more uniform than real models
    "fine": dict(layers=8, experts=128, top_k=8, expert_width=64, max_params=60_000_000,
                 balance="per_layer", balance_coef=0.015, domains=("stdlib", "docs", "man", "packages")),
}
DENSE_INTERMEDIATE = 768    # unused (no dense MLP layers), kept in config
CONTEXT = 512
ROPE_THETA = 10000.0
DOMAIN_CHARS = 12_000_000   # a domain with more text keeps every k-th file, k the smallest that fits
# the installed packages whose sources make the "packages" domain (this project's pins)
SOURCE_PACKAGES = ("transformers", "torch", "mlx_lm", "huggingface_hub", "starlette", "uvicorn",
                   "httpx", "jinja2", "numpy")
TIE_EMBEDDINGS = False
# the speculative draft (--draft): dense, a tenth of the MoE's parameters, ~3 MB at int4
DRAFT_LAYERS = 4
DRAFT_INTERMEDIATE = 768
# optimisation
BATCH = 8                   # windows of CONTEXT tokens per step
LR = 1e-3
MIN_LR_FRAC = 0.1
WARMUP_STEPS = 100
WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.95)
GRAD_CLIP = 1.0
THREADS = 2
# bookkeeping
LOG_EVERY = 10              # steps
EVAL_EVERY_S = 300          # evaluate + checkpoint + HF save every ~5 minutes
EVAL_WINDOWS = 32           # fixed held-out windows of CONTEXT tokens
TRAIN_SAMPLE_CHARS = 20000
END_RESERVE_S = 60          # stop the loop this long before the deadline for the final save
EOT = "<|endoftext|>"
# the bundled model's ChatML with tool calls (renders plain chats exactly as ChatML does)
CHAT_TEMPLATE = (Path(__file__).resolve().parents[1] / "edgemoe" / "models" / "fine"
                 / "chat_template.jinja").read_text()
EXCLUDE_DIRS = {"test", "tests", "idlelib", "site-packages"}


# ---------------------------------------------------------------- data
def stdlib_files():
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if EXCLUDE_DIRS.intersection(rel.parts[:-1]) or not p.is_file():
            continue
        out.append(rel.as_posix())
    out.sort()
    return root, out


def read_text(path):
    return Path(path).read_bytes().decode("utf-8", errors="replace")


# Each domain lists its files as (estimated characters, reader), sorted by path.
def stdlib_docs():
    """CPython's standard library sources (tests, idlelib, site-packages excluded)."""
    root, rels = stdlib_files()
    return [((root / rel).stat().st_size, lambda p=root / rel: read_text(p)) for rel in rels]


def python_docs():
    """The Python documentation as reStructuredText (Debian's python3-doc)."""
    root = Path("/usr/share/doc/python3/html/_sources")
    if not root.is_dir():
        sys.exit(f"docs domain: expected {root} (apt-get install python3-doc), found none")
    return [(p.stat().st_size, lambda p=p: read_text(p)) for p in sorted(root.rglob("*.rst.txt"))]


MAN_CHARS_PER_BYTE = 3.1    # rendered text per byte of gzipped roff, measured on this machine's pages


def man_pages():
    """The English manual pages installed on the machine, rendered to plain text by man(1)."""
    files = sorted(p for p in Path("/usr/share/man").glob("man[1-8]/*") if p.is_file() and not p.is_symlink())
    env = dict(os.environ, MANWIDTH="80", LANG="C.UTF-8")

    def render(p):
        r = subprocess.run(f"man -l -P cat {str(p)!r} 2>/dev/null | col -bx", shell=True,
                           capture_output=True, env=env)
        return r.stdout.decode("utf-8", errors="replace")
    return [(p.stat().st_size * MAN_CHARS_PER_BYTE, lambda p=p: render(p)) for p in files]


def package_sources():
    """The sources of installed packages (SOURCE_PACKAGES), their tests excluded."""
    import importlib.util
    files = []
    for name in SOURCE_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            sys.exit(f"packages domain: expected the package {name} installed, found none")
        root = Path(list(spec.submodule_search_locations)[0])
        files += sorted(p for p in root.rglob("*.py")
                        if not EXCLUDE_DIRS.intersection(p.relative_to(root).parts[:-1]))
    return [(p.stat().st_size, lambda p=p: read_text(p)) for p in files]


DOMAINS = {"stdlib": stdlib_docs, "docs": python_docs, "man": man_pages, "packages": package_sources}


def read_domain(name):
    """A domain's files, every k-th one with k the smallest that keeps it within about DOMAIN_CHARS."""
    from concurrent.futures import ThreadPoolExecutor
    files = DOMAINS[name]()
    k = 1
    while sum(size for size, _ in files[::k]) > DOMAIN_CHARS:
        k += 1
    with ThreadPoolExecutor(4) as pool:  # man pages render in subprocesses
        return list(pool.map(lambda f: f[1](), files[::k]))


def load_corpus(out, domains=("stdlib",)):
    """Per domain, file i is held out iff i % HELDOUT_EVERY == 0. Cached in OUT/corpus.json."""
    cache = out / "corpus.json"
    if cache.exists():
        corpus = json.loads(cache.read_text())
    else:
        corpus = {}
        for name in tqdm(domains, desc="corpus", unit="domain"):
            texts = read_domain(name)
            corpus[name] = {"train": [t for i, t in enumerate(texts) if i % HELDOUT_EVERY],
                            "heldout": texts[::HELDOUT_EVERY]}
        cache.write_text(json.dumps(corpus))
    train = [t for d in corpus.values() for t in d["train"]]
    held = [t for d in corpus.values() for t in d["heldout"]]
    (out / "heldout.txt").write_text("\n\n".join(held), encoding="utf-8")
    (out / "train.txt").write_text("\n\n".join(train), encoding="utf-8")  # for heads and LoRA
    (out / "train_sample.txt").write_text("\n\n".join(train)[:TRAIN_SAMPLE_CHARS], encoding="utf-8")
    for name, d in corpus.items():
        if len(corpus) > 1:  # per-domain held-out text for the routing statistics
            (out / f"heldout_{name}.txt").write_text("\n\n".join(d["heldout"]), encoding="utf-8")
        print(f"corpus {name}: {len(d['train'])} train, {len(d['heldout'])} held-out files; "
              f"{sum(map(len, d['train']))/1e6:.2f}M / {sum(map(len, d['heldout']))/1e6:.2f}M chars")
    return train, held


def build_tokenizer(train_texts, hf_dir, given=None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    for folder in (given, hf_dir):  # a draft takes its target's tokenizer
        if folder is not None and (folder / "tokenizer.json").exists():
            return PreTrainedTokenizerFast.from_pretrained(folder)
    if given is not None:
        sys.exit(f"--tokenizer {given}: expected tokenizer.json there, found none")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(train_texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT, pad_token=EOT, bos_token=None,
                                   unk_token=None, model_max_length=CONTEXT)
    fast.chat_template = CHAT_TEMPLATE
    hf_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(hf_dir)
    return fast


def tokenize_docs(tok, texts, cache):
    if cache.exists():
        return np.load(cache)
    eot = tok.convert_tokens_to_ids(EOT)
    ids = []
    for enc in tok(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(eot)
    arr = np.asarray(ids, dtype=np.uint16)
    np.save(cache, arr)
    return arr


def unigram_baseline(train_ids, held_ids, vocab):
    counts = np.bincount(train_ids, minlength=vocab).astype(np.float64)
    logp = np.log((counts + 1.0) / (counts.sum() + vocab))
    return float(-logp[held_ids].mean())


# ---------------------------------------------------------------- model
def make_config(tok, shape):
    from transformers import Qwen3MoeConfig
    eot = tok.convert_tokens_to_ids(EOT)
    return Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=DENSE_INTERMEDIATE,
        num_hidden_layers=shape["layers"], num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM, num_experts=shape["experts"], num_experts_per_tok=shape["top_k"],
        moe_intermediate_size=shape["expert_width"], decoder_sparse_step=1, mlp_only_layers=[],
        norm_topk_prob=True, output_router_logits=True,
        router_aux_loss_coef=AUX_LOSS_COEF if shape["balance"] == "global" else 0.0,
        tie_word_embeddings=TIE_EMBEDDINGS, max_position_embeddings=CONTEXT * 4,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        bos_token_id=None, eos_token_id=eot, pad_token_id=eot, use_cache=True,
    )


def make_draft_config(tok):
    from transformers import Qwen3Config
    eot = tok.convert_tokens_to_ids(EOT)
    return Qwen3Config(
        vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=DRAFT_INTERMEDIATE,
        num_hidden_layers=DRAFT_LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM, tie_word_embeddings=True, max_position_embeddings=CONTEXT * 4,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        bos_token_id=None, eos_token_id=eot, pad_token_id=eot, use_cache=True,
    )


def param_report(model, shape=None):
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    router = sum(p.numel() for n, p in model.named_parameters() if ".mlp.gate." in n)
    emb = model.model.embed_tokens.weight.numel()
    head = 0 if model.config.tie_word_embeddings else model.lm_head.weight.numel()
    active = total - experts + (experts * shape["top_k"] // shape["experts"] if shape else experts)
    rep = dict(total=total, routed_experts=experts, routed_frac=experts / total, router=router,
               embed=emb, lm_head=head, attention_norms_etc=total - experts - router - emb - head,
               active_per_token=active, fp32_MB=total * 4 / 1e6, int4_est_MB=total * 5 / 8 / 1e6)
    print("params: " + ", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v:,}" for k, v in rep.items()))
    if shape is None:  # the dense draft
        return rep
    assert rep["routed_frac"] >= 0.80, "routed experts must be >= 80% of parameters"
    assert total <= shape["max_params"], "model too large"
    return rep


def save_hf(model, tok, hf_dir):
    model.save_pretrained(hf_dir, max_shard_size="20MB")
    tok.save_pretrained(hf_dir)
    # mlx-lm 0.32.2 reads the hub-style Qwen3-MoE keys; transformers 5 writes renamed ones.
    cfg_path = hf_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if cfg["model_type"] == "qwen3_moe":
        cfg["num_experts"] = cfg.get("num_local_experts", cfg.get("num_experts"))
    cfg["rope_theta"] = (cfg.get("rope_parameters") or {}).get("rope_theta", ROPE_THETA)
    cfg["rope_scaling"] = None
    cfg["torch_dtype"] = "float32"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    # also keep the chat template inside tokenizer_config.json for tools that only read that file
    tc_path = hf_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["chat_template"] = CHAT_TEMPLATE
    tc_path.write_text(json.dumps(tc, indent=2) + "\n")


def check_mlx_load(hf_dir):
    code = ("from mlx_lm import load, generate; m, t = load(%r); "
            "print('mlx-lm load OK; sample:', repr(generate(m, t, prompt='import os\\n', max_tokens=16)))" % str(hf_dir))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    msg = (r.stdout.strip().splitlines() or [""])[-1] if r.returncode == 0 else "FAILED: " + r.stderr.strip()[-2000:]
    print("mlx check:", msg)
    return r.returncode == 0, msg


@torch.no_grad()
def heldout_loss(model, windows):
    model.eval()
    tot = 0.0
    for i in range(0, len(windows), BATCH):
        x = torch.from_numpy(windows[i:i + BATCH].astype(np.int64))
        logits = model(input_ids=x[:, :-1]).logits
        tot += F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum").item()
    model.train()
    return tot / (len(windows) * CONTEXT)


@torch.no_grad()
def greedy_sample(model, tok, prompt, n=48):
    model.eval()
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    out = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)
    model.train()
    return tok.decode(out[0], skip_special_tokens=False)


def balance_loss(out, shape):
    """The load-balancing loss this run adds itself: DeepSeek's expert-level one (1 when uniform),
    per layer and averaged over layers. Zero for a draft and where transformers adds its own."""
    if shape is None or shape["balance"] != "per_layer":
        return torch.zeros(())
    losses = []
    for logits in out.router_logits:
        probs = logits.float().softmax(-1)
        chosen = probs.topk(shape["top_k"], dim=-1).indices.reshape(-1)
        share = torch.bincount(chosen, minlength=shape["experts"]).float() / chosen.numel()
        losses.append(shape["experts"] * (share * probs.mean(0)).sum())
    return shape["balance_coef"] * torch.stack(losses).mean()


def lr_at(step, progress):
    if step < WARMUP_STEPS:
        return LR * (step + 1) / WARMUP_STEPS
    progress = min(max(progress, 0.0), 1.0)
    return LR * (MIN_LR_FRAC + (1 - MIN_LR_FRAC) * 0.5 * (1 + math.cos(math.pi * progress)))


# ---------------------------------------------------------------- framework benchmark
def bench(tok, shape):
    """Train steps/s of the same shape in PyTorch and MLX, random tokens, batch BATCH x 256."""
    from transformers import Qwen3MoeForCausalLM
    T, n = 256, 6
    cfg = make_config(tok, shape)
    m = Qwen3MoeForCausalLM(cfg)
    opt = torch.optim.AdamW(m.parameters(), lr=LR)
    ts = []
    for _ in range(n):
        x = torch.randint(0, cfg.vocab_size, (BATCH, T))
        t = time.time()
        out = m(input_ids=x, labels=x)
        (out.loss + balance_loss(out, shape)).backward()
        opt.step(); opt.zero_grad(set_to_none=True)
        ts.append(time.time() - t)
    print(f"bench torch: {BATCH * T / np.mean(ts[2:]):.0f} tok/s  steps {np.round(ts, 2).tolist()}")
    import mlx.core as mx
    import mlx.nn as mnn
    import mlx.optimizers as mopt
    from mlx_lm.models.qwen3_moe import Model, ModelArgs
    args = ModelArgs(model_type="qwen3_moe", hidden_size=HIDDEN, num_hidden_layers=shape["layers"],
                     intermediate_size=DENSE_INTERMEDIATE, num_attention_heads=HEADS,
                     num_experts=shape["experts"], num_experts_per_tok=shape["top_k"], decoder_sparse_step=1,
                     mlp_only_layers=[], moe_intermediate_size=shape["expert_width"], rms_norm_eps=1e-6, vocab_size=cfg.vocab_size,
                     num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, rope_theta=ROPE_THETA,
                     tie_word_embeddings=TIE_EMBEDDINGS, max_position_embeddings=CONTEXT, norm_topk_prob=True)
    mm = Model(args)
    mx.eval(mm.parameters())
    mo = mopt.AdamW(learning_rate=LR)
    lg = mnn.value_and_grad(mm, lambda mod, a, b: mnn.losses.cross_entropy(mod(a), b).mean())
    ts = []
    for _ in range(4):
        x = mx.random.randint(0, cfg.vocab_size, (BATCH, T + 1))
        t = time.time()
        loss, g = lg(mm, x[:, :-1], x[:, 1:])
        mo.update(mm, g)
        mx.eval(mm.parameters(), mo.state, loss)
        ts.append(time.time() - t)
    print(f"bench mlx:   {BATCH * T / np.mean(ts[1:]):.0f} tok/s  steps {np.round(ts, 2).tolist()}")


# ---------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--minutes", type=float, default=60.0, help="wall-clock budget from script start")
    ap.add_argument("--steps", type=int, default=None,
                    help="train exactly this many steps (schedule on steps, reproducible); overrides --minutes")
    ap.add_argument("--bench", action="store_true", help="only measure PyTorch vs MLX train tokens/s")
    ap.add_argument("--threads", type=int, default=THREADS,
                    help="torch threads; 1 is faster when other work shares the 2 cores")
    ap.add_argument("--draft", action="store_true",
                    help="train the dense speculative draft (DRAFT_* shape) instead of the MoE")
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="folder whose tokenizer.json to use (a draft's target) instead of training one")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="reference",
                    help="reference: 32 experts, top-2, stdlib, its own tokenizer (no longer bundled); fine: "
                         "the bundled model, 128 experts of width 64, top-8, on mixed domains, "
                         "with the bundled tokenizer")
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    if args.shape == "fine" and args.tokenizer is None:
        args.tokenizer = Path(__file__).resolve().parent.parent / "edgemoe/models/fine"
    t_start = time.time()
    deadline = float("inf") if args.steps else t_start + args.minutes * 60
    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    out = args.out
    hf_dir, ckpt_dir = out / "hf", out / "ckpt"
    for d in (out, hf_dir, ckpt_dir):
        d.mkdir(parents=True, exist_ok=True)

    train_texts, held_texts = load_corpus(out, shape["domains"])
    tok = build_tokenizer(train_texts, hf_dir, args.tokenizer)
    if args.bench:
        return bench(tok, shape)
    train_ids = tokenize_docs(tok, train_texts, out / "train_ids.npy")
    held_ids = tokenize_docs(tok, held_texts, out / "heldout_ids.npy")
    del train_texts, held_texts
    uni = unigram_baseline(train_ids, held_ids, len(tok))
    print(f"tokens: train {len(train_ids):,}  held-out {len(held_ids):,}  vocab {len(tok)}  "
          f"unigram baseline {uni:.4f} nats/token (ppl {math.exp(uni):.1f})")
    starts = np.linspace(0, len(held_ids) - CONTEXT - 1, EVAL_WINDOWS).astype(np.int64)
    eval_windows = np.stack([held_ids[s:s + CONTEXT + 1] for s in starts])

    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM
    model = (Qwen3ForCausalLM(make_draft_config(tok)) if args.draft
             else Qwen3MoeForCausalLM(make_config(tok, shape)))
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.bos_token_id = None
    shape = None if args.draft else shape
    rep = param_report(model, shape)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                             {"params": no_decay, "weight_decay": 0.0}], lr=LR, betas=BETAS)
    rng = np.random.default_rng(SEED)
    step, tokens_seen, train_s, best = 0, 0, 0.0, float("inf")
    mlx_checked = False
    ckpt_path = ckpt_dir / "last.pt"
    log = open(out / "train_log.jsonl", "a")

    def logj(**kw):
        kw["time"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        log.write(json.dumps(kw) + "\n")
        log.flush()

    if ckpt_path.exists():
        ck = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        step, tokens_seen, train_s, best = ck["step"], ck["tokens_seen"], ck["train_s"], ck["best_heldout"]
        rng.bit_generator.state = ck["np_rng"]
        torch.set_rng_state(ck["torch_rng"])
        mlx_checked = ck.get("mlx_checked", False)
        print(f"resumed from {ckpt_path}: step {step}, {tokens_seen:,} tokens, {train_s / 60:.1f} train min")
    logj(event="start", step=step, unigram_baseline=uni, train_tokens=int(len(train_ids)),
         heldout_tokens=int(len(held_ids)), params=rep, minutes=args.minutes, steps=args.steps)

    def checkpoint():
        nonlocal best, mlx_checked
        hl = heldout_loss(model, eval_windows)
        best = min(best, hl)
        torch.save(dict(model=model.state_dict(), optimizer=opt.state_dict(), step=step, tokens_seen=tokens_seen,
                        train_s=train_s, best_heldout=best, np_rng=rng.bit_generator.state,
                        torch_rng=torch.get_rng_state(), mlx_checked=mlx_checked), ckpt_path.with_suffix(".tmp"))
        os.replace(ckpt_path.with_suffix(".tmp"), ckpt_path)
        save_hf(model, tok, hf_dir)
        logj(event="eval", step=step, tokens_seen=tokens_seen, heldout_loss=hl, heldout_ppl=math.exp(hl),
             unigram_baseline=uni)
        tqdm.write(f"step {step}: held-out loss {hl:.4f} (ppl {math.exp(hl):.2f}), unigram {uni:.4f}; "
                   f"saved {ckpt_path} and {hf_dir}")
        if not mlx_checked:
            ok, msg = check_mlx_load(hf_dir)
            logj(event="mlx_check", ok=ok, msg=msg)
            mlx_checked = ok
        return hl

    model.train()
    loop_t0 = time.time()
    train_s0 = train_s
    sched_total = None if args.steps else train_s0 + max(deadline - END_RESERVE_S - loop_t0, 1.0)
    last_eval = time.time()
    win_t, win_tok = time.time(), 0
    pbar = tqdm(desc="train", unit="step", initial=step, total=args.steps, mininterval=30, dynamic_ncols=False)
    n = len(train_ids) - CONTEXT - 1
    def progress():
        return step / args.steps if args.steps else train_s / sched_total

    def more():
        return step < args.steps if args.steps else time.time() < deadline - END_RESERVE_S

    while more():
        lr = lr_at(step, progress())
        for g in opt.param_groups:
            g["lr"] = lr
        idx = rng.integers(0, n, size=BATCH)
        x = torch.from_numpy(np.stack([train_ids[i:i + CONTEXT] for i in idx]).astype(np.int64))
        outp = model(input_ids=x, labels=x)
        balance = balance_loss(outp, shape)
        (outp.loss + balance).backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += BATCH * CONTEXT
        win_tok += BATCH * CONTEXT
        train_s = train_s0 + time.time() - loop_t0
        if step % LOG_EVERY == 0:
            coef = shape["balance_coef"] if shape is not None else 0.0
            aux = outp.aux_loss.item() if getattr(outp, "aux_loss", None) is not None else 0.0
            if shape is not None and shape["balance"] == "per_layer":
                aux = balance.item() / coef
            loss = outp.loss.item() + balance.item()
            tps = win_tok / (time.time() - win_t)
            win_t, win_tok = time.time(), 0
            logj(event="train", step=step, loss=loss, ce=loss - coef * aux, aux=aux, lr=lr,
                 grad_norm=float(gnorm), tokens_seen=tokens_seen, tok_per_s=tps)
            pbar.set_postfix(ce=f"{loss - coef * aux:.3f}", aux=f"{aux:.3f}", tps=f"{tps:.0f}",
                             tok=f"{tokens_seen / 1e6:.2f}M", refresh=False)
        pbar.update(1)
        if time.time() - last_eval >= EVAL_EVERY_S:
            checkpoint()
            last_eval = time.time()
            win_t, win_tok = time.time(), 0
    pbar.close()
    hl = checkpoint()
    wall = time.time() - t_start
    print(f"\nfinal: step {step}, tokens seen {tokens_seen:,}, train time {train_s / 60:.1f} min, "
          f"wall this run {wall / 60:.1f} min")
    print(f"held-out loss {hl:.4f} nats/token (ppl {math.exp(hl):.2f}); best {best:.4f}; "
          f"unigram baseline {uni:.4f} (ppl {math.exp(uni):.1f})")
    for prompt in ("def ", "import os\n"):
        print(f"--- greedy sample from {prompt!r}:\n{greedy_sample(model, tok, prompt)}\n---")
    logj(event="end", step=step, tokens_seen=tokens_seen, heldout_loss=hl, best_heldout=best,
         unigram_baseline=uni, wall_s=wall, train_s=train_s)


if __name__ == "__main__":
    main()
