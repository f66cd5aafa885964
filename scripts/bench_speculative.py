"""Benchmark: speculative decoding against plain decode on a streamed model, side by side.

Per draft source, expert budget and
read regime (a read-rate cap through edgemoe.constrained, as on a Mac where reads
dominate, and unthrottled), each configuration runs in its own process with O_DIRECT
expert reads (nothing served from the page cache), over held-out prompts of the bundled
model's corpus (the first tokens of standard-library files it never trained on), and the
rounds alternate configurations. Reports decode tok/s as a ratio to plain decode at the
same budget and regime, the share of tokens that came from the draft and were kept,
expert bytes read per generated token, and ms blocked on reads per token. JSON + PNG.

Decoding samples (--temp 0.7 --top-p 0.9, seeded per prompt, as README's main command)
by default: greedy decode of this small model falls into loops within a few tokens
(`_D_D_D...`, `from_from_from...`), which any draft predicts and whose experts stay in
slots, so greedy figures flatter speculation. `--temp 0` measures greedy decode anyway.

Sources (--sources): plain (no draft); lookup (prompt lookup, our loop, adaptive length);
with --draft-model: mlx-draft (mlx-lm's own speculative loop, a fixed length), draft (our
loop, DraftModel, length adapted: edgemoe.mlx_backend.drafts.DraftLength) and draft-fixed (our
loop, a fixed length).

    python scripts/bench_speculative.py [--model PACK] [--draft-model MLX_DIR]
        [--sources plain,lookup,draft] [--read-bps 20M,none] [--budgets 0.10,0.25]
        [--rounds 3] [--out bench_out]
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from plotting import pyplot

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINED = [sys.executable, "-m", "edgemoe.constrained"]  # a memory / read-rate cgroup


def heldout_prompts(tokenizer, n: int, length: int):
    """The first `length` tokens of n held-out standard-library files (those the bundled
    model's training script holds out: every 20th in sorted order) of at least that
    length."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from train_reference_moe import HELDOUT_EVERY, stdlib_files

    root, rels = stdlib_files()
    prompts = []
    for rel in rels[::HELDOUT_EVERY]:
        ids = tokenizer.encode((root / rel).read_text(errors="replace"))
        if len(ids) >= length:
            prompts.append(ids[:length])
        if len(prompts) == n:
            break
    return prompts


def worker(args) -> dict:
    import mlx.core as mx

    import edgemoe
    from edgemoe.mlx_backend.drafts import DraftModel
    from edgemoe.mlx_backend.generation import stream_generate
    from edgemoe.mlx_backend.lookup import PromptLookup

    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = edgemoe.load(args.model, expert_budget=float(args.budget), io="direct")
    kw = {}
    if args.source == "lookup":
        kw = {"draft_model": PromptLookup(args.num_draft_tokens)}
    elif args.source != "plain":
        from mlx_lm import load as mlx_lm_load
        resident = mlx_lm_load(args.draft_model)[0]
        kw = {"draft_model": resident, "num_draft_tokens": args.num_draft_tokens} \
            if args.source == "mlx-draft" else \
            {"draft_model": DraftModel(resident, args.num_draft_tokens),
             "adaptive": args.source == "draft"}
    store = model.expert_store
    tokens = kept = 0
    samples = []  # what was decoded (the sources sample alike: compare them)
    decode_s = 0.0
    read = blocked = 0.0
    for i, prompt in enumerate(heldout_prompts(tokenizer, args.prompts, args.prompt_len)):
        mx.random.seed(args.seed + i)
        responses = stream_generate(model, tokenizer, mx.array(prompt), max_tokens=args.decode,
                                    sampler=make_sampler(args.temp, args.top_p), **kw)
        first = next(responses)  # the prompt's prefill and the first token: not decode
        before, tic = store.snapshot(), time.perf_counter()
        n, text = 0, first.text
        for r in responses:
            n += 1
            kept += bool(r.from_draft)
            text += r.text
        samples.append(text)
        decode_s += time.perf_counter() - tic
        d = store.snapshot() - before
        tokens += n
        read += d.bytes_read
        blocked += d.blocked_s
        del first
    store.close()
    return {"tok_s": tokens / decode_s, "kept": kept / tokens, "read_per_token": read / tokens,
            "blocked_ms_per_token": 1000 * blocked / tokens, "tokens": tokens,
            "samples": samples}


def run(source: str, budget: str, regime: str, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--source", source, "--budget", budget,
           "--model", args.model, "--prompts", str(args.prompts),
           "--prompt-len", str(args.prompt_len), "--decode", str(args.decode),
           "--num-draft-tokens", str(args.num_draft_tokens), "--temp", str(args.temp),
           "--top-p", str(args.top_p), "--seed", str(args.seed)]
    if args.draft_model:
        cmd += ["--draft-model", args.draft_model]
    if regime != "none":
        cmd = [*CONSTRAINED, "--read-bps", regime, "--disk-of", args.model, "--"] + cmd
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def plot(rows, png: Path):
    plt = pyplot()

    names = [f"{r['source']} {float(r['budget']):.0%} {r['regime']}" for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    for ax, key, title in ((axes[0], "ratio", "decode tok/s, ratio to plain decode"),
                           (axes[1], "read_ratio", "expert bytes read per token, ratio"),
                           (axes[2], "kept", "share of tokens drafted and kept")):
        ax.bar(names, [r[key] for r in rows],
               color=["tab:gray" if r["source"] == "plain" else "tab:blue" for r in rows])
        ax.axhline(1.0 if key != "kept" else 0, color="k", lw=0.5)
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", rotation=45, labelsize=8)
        plt.setp(ax.get_xticklabels(), ha="right", rotation_mode="anchor")
    fig.tight_layout()
    fig.savefig(png, dpi=100)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(ROOT / "edgemoe" / "models" / "fine"))
    p.add_argument("--draft-model", default=None, help="An mlx-lm draft model (resident)")
    p.add_argument("--sources", default=None,
                   help="Draft sources to run, comma-separated (default: plain,lookup, and "
                        "with --draft-model also mlx-draft,draft,draft-fixed)")
    p.add_argument("--read-bps", default="20M,none",
                   help="Read-rate caps to run under, 'none' for unthrottled")
    p.add_argument("--budgets", default="0.10,0.25")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--num-draft-tokens", type=int, default=3)
    p.add_argument("--temp", type=float, default=0.7, help="0: greedy")
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=3, help="prompt i samples with seed + i")
    p.add_argument("--out", default="bench_out")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--source", help=argparse.SUPPRESS)
    p.add_argument("--budget", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    sources = args.sources.split(",") if args.sources else \
        ["plain", "lookup"] + (["mlx-draft", "draft", "draft-fixed"] if args.draft_model else [])
    if "plain" not in sources:
        sources.insert(0, "plain")  # the ratios' denominator
    if not args.draft_model and set(sources) - {"plain", "lookup"}:
        p.error(f"--sources {args.sources}: the draft sources need --draft-model")
    configs = [(s, b, r) for r in args.read_bps.split(",") for b in args.budgets.split(",")
               for s in sources]
    runs = {c: [] for c in configs}
    for i in range(args.rounds):
        for c in configs:  # alternate: every round runs every configuration
            runs[c].append(run(*c, args))
            print(f"round {i + 1}/{args.rounds} {c}: {runs[c][-1]['tok_s']:.1f} tok/s",
                  file=sys.stderr, flush=True)
    rows = []
    for (source, budget, regime), rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "samples"}
        plain = runs[("plain", budget, regime)]
        # ratios round by round (the same round's plain run), then their median
        med["ratio"] = statistics.median(r["tok_s"] / q["tok_s"] for r, q in zip(rs, plain))
        med["read_ratio"] = statistics.median(r["read_per_token"] / q["read_per_token"]
                                              for r, q in zip(rs, plain))
        rows.append({"source": source, "budget": budget, "regime": regime, **med})
    print(f"{'source':11} {'budget':>6} {'reads':>6} {'tok/s':>7} {'ratio':>6} {'kept':>6} "
          f"{'KB read/tok':>11} {'read ratio':>10} {'blocked ms/tok':>14}")
    for r in rows:
        print(f"{r['source']:11} {float(r['budget']):6.0%} {r['regime']:>6} {r['tok_s']:7.1f} "
              f"{r['ratio']:6.2f} {r['kept']:6.1%} {r['read_per_token'] / 1e3:11.1f} "
              f"{r['read_ratio']:10.2f} {r['blocked_ms_per_token']:14.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_speculative.json").write_text(json.dumps(
        {"model": args.model, "draft_model": args.draft_model, "rounds": args.rounds,
         "prompts": args.prompts, "prompt_len": args.prompt_len, "decode": args.decode,
         "num_draft_tokens": args.num_draft_tokens, "temp": args.temp, "top_p": args.top_p,
         "seed": args.seed, "rows": rows,
         "runs": {"|".join(c): rs for c, rs in runs.items()}}, indent=1))
    plot(rows, out / "bench_speculative.png")
    print(f"wrote {out / 'bench_speculative.json'} and {out / 'bench_speculative.png'}")


if __name__ == "__main__":
    main()
