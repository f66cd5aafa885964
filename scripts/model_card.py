"""Measure a reference MoE and write its model card (README.md + a PNG).

    python scripts/model_card.py --run RUN --pack edgemoe/models/fine
    python scripts/model_card.py --draft --run RUN/draft --pack edgemoe/models/fine-draft

--draft: the card of the speculative draft (train_reference_moe.py --draft) instead: its
perplexity, fp32 and int4, and its top-1 agreement with its MoE, the pack beside it named
without "-draft" (the share of greedy drafts the target keeps, token by token).

--assets: rewrite only the card's section on what was trained for the pack (its prerouter
heads, recovery LoRA and cache policy, from their reports), as rebuild_reference.sh does
after it retrains one; no --run needed.

--agent RUN: add (or rewrite) the card's section on the agent stage
(scripts/train_agent_stage.py --out RUN): its context and chat-turn figures, from
RUN/eval_before.json and RUN/eval_after.json (scripts/eval_agent_model.py, the pack before
and after the stage), and the context and size the architecture line states.

--run is the folder train_reference_moe.py wrote (hf/, heldout.txt, train_log.jsonl).
Measures on the held-out text, with edgemoe.eval: perplexity of the unquantized model
and of the int4 pack, their top-1 agreement and KL, and the pack's per-layer expert
usage and routing entropy.
"""

import argparse
import json
import math
import platform
from datetime import datetime
from pathlib import Path

from edgemoe.eval import ModelConfig, evaluate
from plotting import pyplot

CARD = """# {title}

{intro}

## Architecture
Qwen3-MoE (mlx-lm's `qwen3_moe`): {layers} decoder layers, all MoE; hidden size {hidden};
{heads} attention heads ({kv_heads} key/value heads, head dim {head_dim}); {experts} routed experts
per layer, top-{top_k} with renormalised weights; expert FFN width {moe_ffn}; vocabulary {vocab}
(byte-level BPE); positions up to {context}; untied embeddings. {params:,} parameters, of which routed
experts {expert_frac:.1%}. Stored here as an edgemoe pack, int4 (group 64, as `mlx_lm.convert -q`):
{pack_mb:.1f} MB.

## Data
{data}
Trained with PyTorch on 2 CPU cores:
{tokens:,} tokens seen ({epochs:.2f} passes over {train_tokens:,} training tokens) in {minutes:.0f} minutes,
{steps} steps.

## Quality on the held-out files ({eval_tokens:,} tokens, windows of {window})
| model | held-out loss (nats/token) | perplexity |
|---|---|---|
| unigram baseline (train token frequencies) | {unigram:.3f} | {unigram_ppl:.1f} |
| this model, fp32 | {fp32_nll:.3f} | {fp32_ppl:.2f} |
| this model, int4 pack | {int4_nll:.3f} | {int4_ppl:.2f} |

int4 vs fp32: top-1 agreement {agree:.1%}, mean KL {kl:.4f} nats/token.

## Routing (int4 pack, held-out text)
| layer | routing entropy (bits, max {max_bits:.0f}) | experts used | busiest expert share |
|---|---|---|---|
{routing_rows}

![expert usage per layer](expert_usage.png)
{routing_stats}
## Sample (temperature 0.7, top-p 0.9, seed 3, 25% expert budget)
```
{sample}
```

{assets}## Reproduce
```
python scripts/train_reference_moe.py{shape_flag} --out RUN --steps {steps}
python -m edgemoe.convert --hf-path RUN/hf --mlx-path {pack} --overwrite
python scripts/model_card.py --run RUN --pack {pack}
```
The unquantized model (RUN/hf, {fp32_mb:.0f} MB) is not shipped: the first command rebuilds it
(`{rebuild} RUN` then rebuilds the pack and everything trained for it). Its schedule runs on the step count and its data order on a
seeded generator, so a rerun on the same software gives the same weights (two 5-step runs
on this machine wrote byte-identical safetensors).
"""


DRAFT_CARD = """# edgemoe reference draft

The speculative draft of the reference MoE `{target}`: a small dense
model trained by edgemoe on the same corpus, split and tokenizer, so that
`--draft-model {pack}` drafts tokens the MoE verifies (edgemoe.generate,
edgemoe.server, scripts/bench_speculative.py).

## Architecture
Qwen3 (mlx-lm's `qwen3`), dense: {layers} decoder layers; hidden size {hidden}; {heads} attention
heads ({kv_heads} key/value heads, head dim {head_dim}); MLP width {ffn}; vocabulary {vocab} (the
MoE's tokenizer); tied embeddings. {params:,} parameters. int4 (group 64, `mlx_lm.convert -q`):
{size_mb:.1f} MB.

## Data
The MoE's: {data}
Trained with PyTorch on 2 CPU cores: {tokens:,} tokens seen ({epochs:.2f} passes) in
{minutes:.0f} minutes, {steps} steps.

## Quality on the held-out files ({eval_tokens:,} tokens, windows of {window})
| model | held-out loss (nats/token) | perplexity |
|---|---|---|
| this draft, fp32 | {fp32_nll:.3f} | {fp32_ppl:.2f} |
| this draft, int4 | {int4_nll:.3f} | {int4_ppl:.2f} |
| the MoE, int4 pack | {moe_nll:.3f} | {moe_ppl:.2f} |

Top-1 agreement of this draft (int4) with the MoE: {agree:.1%} of next tokens (mean KL(MoE ||
draft) {kl:.3f} nats/token): about the share of greedy drafts the MoE keeps.

## Reproduce
```
python scripts/train_reference_moe.py --draft{shape_flag} --tokenizer {target} --out RUN --steps {steps}
python -m mlx_lm convert --hf-path RUN/hf --mlx-path {pack} -q
python scripts/model_card.py --draft --run RUN --pack {pack}
```
"""


REFERENCE_INTRO = """A small Mixture-of-Experts language model trained from scratch by edgemoe, so that routing,
prefetch and cache measurements run on learned routing rather than random weights. No longer
bundled (the fine-grained reference replaced it); load it by its folder:
`python -m edgemoe.generate --model {pack}`."""

FINE_INTRO = """A small Mixture-of-Experts language model trained from scratch by edgemoe with fine-grained
experts, routed as today's MoEs are (128 experts, top-8, as Qwen3-30B-A3B), so that cache,
prefetch and routing measurements run on routing like theirs: the coarse reference model's 32
experts (top-2) are far more skewed. Its active expert width per token is the coarse model's
(8 x 64 = 2 x 256), and so is its tokenizer. It is the bundled model: the default of
`edgemoe.load()` and `python -m edgemoe.generate`."""

STDLIB_DATA = """Python's own standard library sources (CPython {python}, `.py` files, tests and idlelib excluded),
split by file: 1 file in 20 held out, never trained on."""

DOMAIN_NAMES = {
    "stdlib": "CPython {python}'s standard library sources (`.py`; tests and idlelib excluded)",
    "docs": "the Python documentation's reStructuredText (Debian's python3-doc)",
    "man": "the manual pages installed on the build machine, rendered to text by man(1)",
    "packages": "sources of installed packages (transformers, torch, mlx_lm, huggingface_hub, "
                "starlette, uvicorn, httpx, jinja2, numpy; tests excluded)",
}


def data_section(run: Path) -> str:
    """What the model was trained on: one domain, or each domain of a mixed corpus with its size."""
    python = platform.python_version()
    corpus = json.loads((run / "corpus.json").read_text()) if (run / "corpus.json").exists() else {}
    if len(corpus) <= 1:
        return STDLIB_DATA.format(python=python)
    rows = ["Four domains, each split by file (1 file in 20 held out, never trained on) and thinned",
            "to about 12M characters by keeping every k-th file:", "",
            "| domain | train files | held-out files | train characters |", "|---|---|---|---|"]
    rows += [f"| {DOMAIN_NAMES[name].format(python=python)} | {len(d['train']):,} | "
             f"{len(d['heldout']):,} | {sum(map(len, d['train'])) / 1e6:.1f}M |"
             for name, d in corpus.items()]
    return "\n".join(rows) + "\n"


def routing_stats_section(pack: Path) -> str:
    """The routing statistics of teacher-forced held-out passages (scripts/routing_stats.py),
    beside what is published for real fine-grained MoEs."""
    path = pack / "routing_stats.json"
    if not path.exists():
        return ""
    import importlib.util
    spec = importlib.util.spec_from_file_location("routing_stats", Path(__file__).with_name("routing_stats.py"))
    stats = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stats)
    report = json.loads(path.read_text())
    lines = ["", "### Routing statistics", "Teacher-forced decode of held-out passages of every domain "
             "(`scripts/routing_stats.py`; `routing_stats.json`): ", "",
             stats.markdown(report), "", "Published for real fine-grained MoEs:", "",
             "| model | statistic | figure |", "|---|---|---|"]
    lines += [f"| {m} | {k} | {v} |" for m, k, v in stats.PUBLISHED]
    return "\n".join(lines) + "\n"


ASSETS = "## Trained for it"


def assets_section(pack: Path) -> str:
    """The card's section on the pack's prerouter heads, recovery LoRA and cache policy,
    from the reports their training wrote."""
    lines = [ASSETS, "Distilled from this pack on the training split "
             f"(`MODEL={pack.name} scripts/rebuild_reference.sh RUN heads lora traces`).", ""]
    for folder in ("prerouter", "prerouter-same-token"):  # the second: --prerouter PACK/folder
        heads = pack / folder / "report.json"
        if not heads.exists():
            continue
        r = json.loads(heads.read_text())
        use = ("" if folder == "prerouter" else
               f" (route by them: `--prerouter edgemoe/models/{pack.name}/{folder}`)")
        lines += [f"`{folder}/`: {r['variant'].replace('_', '-')} prerouter heads (hidden "
                  f"{r['head_hidden']}, {r['train_tokens']:,} training tokens, {r['epochs']} "
                  f"epochs). Held-out recall of the top-{r['top_k']} experts ({r['eval_tokens']:,} "
                  f"tokens), beside two guesses that need no training: the layer's own router "
                  f"applied to the source layer's input of the same token, and the previous "
                  f"token's routing repeated{use}:", "",
                  "| layer | from layer | head | exact set | router, same token | previous token's |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {l['target']} | {l['source']} | {l['head']['recall']:.1%} | "
                  f"{l['head']['exact']:.1%} | {l['baseline_same_token']['recall']:.1%} | "
                  f"{l['repeat_previous_token']['recall']:.1%} |" for l in r["layers"]]
        lines.append("")
        if folder == "prerouter":
            lines += [shipped_routing(pack / folder), ""]
    lora = pack / "adapter" / "report.json"
    if lora.exists():
        r = json.loads(lora.read_text())
        b, a, params = r["before"], r["after"], r["lora"]
        experts = any(".switch_mlp." in k for k in params["keys"])
        teacher = ("this pack, native routing" if r["teacher"] == r["model"]
                   else "the unquantized model")
        lines += [f"`adapter/`: the recovery LoRA of the {r['routing']} mode (rank "
                  f"{params['rank']}, the attention{' and every routed expert' if experts else ''}"
                  f"; {r['steps']:,} steps, {r['train_tokens_seen']:,} tokens), served unmerged. "
                  f"On {a['tokens']:,} held-out tokens, against its teacher ({teacher}, "
                  f"perplexity {a['teacher_perplexity']:.2f}):", "",
                  "| | perplexity | KL to the teacher | top-1 agreement |", "|---|---|---|---|",
                  f"| {r['routing']} | {b['perplexity']:.2f} | {b['kl_to_teacher']:.3f} | "
                  f"{b['top1_agreement']:.1%} |",
                  f"| {r['routing']} + adapter | {a['perplexity']:.2f} | "
                  f"{a['kl_to_teacher']:.3f} | {a['top1_agreement']:.1%} |", ""]
    if (pack / "cache_policy.npz").exists() and (pack / "routing_stats.json").exists():
        lines += ["`cache_policy.npz`: the learned cache policy's weights, fitted on the "
                  "teacher-forced decode traces of the routing statistics above.", ""]
    elif (pack / "cache_policy.npz").exists():
        lines += ["`cache_policy.npz`: the learned cache policy's weights, fitted on 8 decode "
                  "traces of held-out passages at a 25% expert budget.", ""]
    return "\n".join(lines) + "\n"


def shipped_routing(heads: Path) -> str:
    """How `--routing prerouted` routes by the pack's heads: their config's modes."""
    config = json.loads((heads / "prerouter_config.json").read_text())
    native = sorted(config.get("native_layers", []))
    predicted = [int(t) for t in sorted(config["sources"], key=int) if int(t) not in native]
    how = (f"the router chooses among the experts in slots and the heads' "
           f"{config['conditional']} most likely, which are read a token ahead "
           f"(cache-conditional routing)" if config.get("conditional") else
           "the heads' prediction is the routing, read a token ahead")
    adapter = ""
    if config.get("adapter"):  # the heads' own (edgemoe.routing.between --adapter)
        from edgemoe.format.adapters import expert_key
        from edgemoe.format.resident import read_safetensors_header

        names = read_safetensors_header(heads / config["adapter"] / "adapters.safetensors")[0]
        layers = sorted({int(n.split(".")[2]) for n in names})
        what = ("its attention only: no expert deltas, no bytes added to a read"
                if not any(expert_key(n) for n in names) else
                "the experts' deltas included, streamed with them")
        adapter = (f" The heads load their own adapter with them (`prerouter/"
                   f"{config['adapter']}/`, unless another is given): the tensors of "
                   f"`adapter/` for layers {_span(layers)}, {what}.")
    return (f"`--routing prerouted` routes by them as their `prerouter_config.json` says "
            f"(docs/routing.md, the frontier): MoE layers {_span(native)} keep their router "
            f"(the first has no head; the others' heads recall least), and in layers "
            f"{_span(predicted)} {how}.{adapter}")


def _span(layers) -> str:
    layers = list(layers)
    if layers == list(range(layers[0], layers[-1] + 1)) and len(layers) > 2:
        return f"{layers[0]}-{layers[-1]}"
    return ", ".join(map(str, layers))


def update_assets(pack: Path):
    """Replace the card's assets section (up to the next section) by a fresh one."""
    card = (pack / "README.md").read_text()
    start = card.index(ASSETS)
    end = card.index("\n## ", start + len(ASSETS)) + 1
    (pack / "README.md").write_text(card[:start] + assets_section(pack) + card[end:])


AGENT = "## Agent stage"


QAT_WHY = ("`--qat`: trained on the weights as int4 stores them, which convert would "
           "otherwise round the stage's updates away from")


def stage_phases(run: Path) -> list:
    """[(a phase's start event, its steps)], first to last: a --qat phase names the stage
    it started from (--init)."""
    phases, folder = [], run
    while folder is not None:
        log = [json.loads(line) for line in open(folder / "train_log.jsonl")]
        start = next(e for e in log if e["event"] == "start")
        phases.insert(0, (start, sum(e["event"] == "train" for e in log)))
        folder = Path(start["init"]) if start.get("init") not in (None, "None") else None
    return phases


def stage_options(start: dict, rope_theta: float) -> tuple:
    """(the words for the first phase's options, its command line's flags)."""
    every = start.get("short_every") or 0
    nth = {2: "second", 3: "third", 4: "fourth"}.get(every, f"{every}th")
    distil = " (toward the pack's own next-token distributions, `--distil`)"
    words = (f"; every {nth} corpus step is instead eight 512-token windows, the first stage's "
             f"length, so that short context is trained again at the new base"
             + (distil if start.get("distil") else "") if every else "")
    words += f", all quantization-aware ({QAT_WHY})" if start.get("qat") else ""
    flags = ((" --qat" if start.get("qat") else "") + (f" --short-every {every}" if every else "")
             + (" --distil" if start.get("distil") else "")
             + f" --rope-theta {rope_theta:g} --lr {start['lr']:g}")
    return words, flags


def agent_section(run: Path) -> str:
    """The agent stage's section: what it trained, perplexity by context length and the
    share of held-out chat turns ending with stop, before and after."""
    before, after = (json.loads((run / f"eval_{w}.json").read_text()) for w in ("before", "after"))
    phases = stage_phases(run)
    start, steps = phases[0]
    qat = sum(n for s, n in phases[1:] if s.get("qat"))  # a --qat phase after the stage
    last = "QAT" if qat else "RUN"  # the folder whose hf/ is converted
    short, flags = stage_options(start, after["rope_theta"])
    ppl = lambda e, n: e["perplexity"][str(n)]["ppl"]
    lengths = sorted(int(n) for n in after["perplexity"] if n.isdigit())
    lines = [AGENT, f"A last stage, from this pack's first-stage weights (dequantized) with RoPE's base "
             f"raised from {before['rope_theta']:,.0f} to {after['rope_theta']:,.0f}: {steps} steps "
             f"(`scripts/train_agent_stage.py`, learning rate {start['lr']:.1e}), alternating one "
             f"{start['long']:,}-token window of the training corpus and two {start['chat_window']:,}"
             f"-token windows of short chat turns in its ChatML template, each reply ended by "
             f"`<|im_end|>` (`scripts/agent_chat_data.py`: docstrings, signatures and man's NAME lines "
             f"asked for by name; {start['chat_tokens']:,} tokens){short}"
             + (f", then {qat} quantization-aware steps ({QAT_WHY})" if qat else "")
             + ". Generation ends at `<|im_end|>` "
             f"and `<|endoftext|>`; the context is {after['context']:,} tokens. 32K is not trained "
             f"on: it comes from the raised base, measured here. The sections on quality and "
             f"routing describe the first stage's weights; the heads, adapter and cache policy are this "
             f"stage's (`scripts/rebuild_reference.sh RUN pack agent heads lora traces`).", "",
             f"Held-out perplexity of the int4 pack (PyTorch, float32 from int4) by context length, "
             f"on the held-out files of the stdlib and packages domains joined in order "
             f"({after['perplexity']['heldout_tokens']:,} tokens; 512: 32 windows, 2K: 4, 8K: 2, 32K: 1):", "",
             "| pack | " + " | ".join(f"{n:,}" for n in lengths) + " |",
             "|---|" + "---|" * len(lengths)]
    for name, e in (("before the stage", before), ("**this pack**", after)):
        lines.append(f"| {name} | " + " | ".join(f"{ppl(e, n):.2f}" for n in lengths) + " |")
    spans = after["perplexity"].get("32768", {}).get("spans")
    if spans:
        lines += ["", "Within the 32K window, by position: " + ", ".join(
            f"{k}: {v:.2f} (before: {before['perplexity']['32768']['spans'][k]:.2f})"
            for k, v in spans.items()) + "."]
    b, a = before["chat"], after["chat"]
    lines += ["", f"Short chat turns ending with `stop` (not `length`) within {a['max_tokens']} "
              f"tokens, greedy, through edgemoe.generate, on {a['turns']} held-out turns never "
              f"trained on: **{a['stop']}/{a['turns']}** "
              f"(before the stage: {b['stop']}/{b['turns']})."
              + replies_said(a.get("rows", [])),
              "", "```", "python scripts/agent_chat_data.py --corpus CORPUS --out RUN",
              f"python scripts/train_agent_stage.py --pack PACK --corpus CORPUS --out RUN "
              f"--steps {steps}{flags}",
              *([f"python scripts/train_agent_stage.py --pack PACK --corpus CORPUS --out QAT --init RUN "
                 f"--qat --steps {qat}"] if qat else []),
              f"scripts/rebuild_reference.sh {last} pack",
              f"python scripts/eval_agent_model.py --pack PACK --corpus CORPUS --chat RUN/chat_heldout.jsonl "
              f"--json {last}/eval_after.json", f"python scripts/model_card.py --agent {last} --pack PACK", "```",
              "CORPUS: a first-stage run folder (its corpus.json); PACK: the pack before the stage, "
              "then this one (its eval_before.json is the same command on the pack before).", ""]
    return "\n".join(lines) + "\n"


def replies_said(rows) -> str:
    """What the stopped turns said: a model this small ends turns before it answers them."""
    import re
    import statistics
    from collections import Counter

    stopped = [r for r in rows if r["finish_reason"] == "stop"]
    if not stopped:
        return ""
    reply, n = Counter(r["reply"].strip() for r in stopped).most_common(1)[0]
    fence = "`" * (max(map(len, re.findall("`+", reply)), default=0) + 1)  # a code span
    return (f" What they say is mostly not an answer: a median of "
            f"{statistics.median(r['tokens'] for r in stopped):g} tokens, the most common "
            f"reply ({n} of {len(stopped)}) {fence} {reply} {fence}.")


def update_agent(run: Path, pack: Path):
    """Write the agent stage's section after the quality section, and the context and
    size the architecture line states."""
    import re

    card = (pack / "README.md").read_text()
    if AGENT in card:
        start = card.index(AGENT)
        card = card[:start] + card[card.index("\n## ", start + len(AGENT)) + 1:]
    at = card.index("## Routing (")
    card = card[:at] + agent_section(run) + "\n" + card[at:]
    config = json.loads((pack / "config.json").read_text())
    card = re.sub(r"positions up to \d+", f"positions up to {config['max_position_embeddings']}", card)
    size = sum(f.stat().st_size for f in pack.iterdir() if f.is_file()) / 1e6
    card = re.sub(r"\(group 64, as `mlx_lm.convert -q`\):\n[\d.]+ MB",
                  f"(group 64, as `mlx_lm.convert -q`):\n{size:.1f} MB", card)
    (pack / "README.md").write_text(card)


def draft_card(args):
    """The draft's card: its quality and its agreement with its MoE (edgemoe/models/fine for
    edgemoe/models/fine-draft)."""
    target = args.pack.with_name(args.pack.name.removesuffix("-draft"))
    text = (args.run / "heldout.txt").read_text()
    versus = evaluate([ModelConfig(str(target)), ModelConfig(str(args.pack))],
                      text, args.window, args.max_tokens)
    fp32 = evaluate([ModelConfig(str(args.run / "hf"))], text, args.window,
                    args.max_tokens)["configs"][0]
    moe, int4 = versus["configs"]
    log = [json.loads(line) for line in (args.run / "train_log.jsonl").read_text().splitlines()]
    start = next(e for e in log if e["event"] == "start")
    tokens_seen = max(e.get("tokens_seen", 0) for e in log)
    config = json.loads((args.pack / "config.json").read_text())
    fine = json.loads((target / "config.json").read_text())["num_experts"] > 32
    card = DRAFT_CARD.format(
        target=target, pack=args.pack, data=data_section(args.run),
        shape_flag=" --shape fine" if fine else "",
        layers=config["num_hidden_layers"], hidden=config["hidden_size"],
        heads=config["num_attention_heads"], kv_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"], ffn=config["intermediate_size"],
        vocab=config["vocab_size"], params=start["params"]["total"],
        size_mb=sum(f.stat().st_size for f in args.pack.iterdir()) / 1e6, tokens=tokens_seen,
        epochs=tokens_seen / start["train_tokens"], minutes=train_minutes(log),
        steps=max(e.get("step", 0) for e in log), eval_tokens=versus["tokens"],
        window=args.window, fp32_nll=fp32["nll"], fp32_ppl=fp32["perplexity"],
        int4_nll=int4["nll"], int4_ppl=int4["perplexity"], moe_nll=moe["nll"],
        moe_ppl=moe["perplexity"], agree=versus["top1_agreement"], kl=versus["mean_kl"])
    (args.pack / "README.md").write_text(card)
    (args.pack / "measurements.json").write_text(json.dumps(
        {"versus_moe": versus, "fp32": fp32}, indent=1))
    print(card)


def make_sample(pack: Path) -> str:
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    import edgemoe

    mx.random.seed(3)
    model, tokenizer = edgemoe.load(pack, expert_budget=0.25)
    prompt = "def read_lines(path):"
    return prompt + edgemoe.generate(model, tokenizer, tokenizer.encode(prompt), max_tokens=80,
                                     sampler=make_sampler(0.7, 0.9))


def train_minutes(log) -> float:
    """Wall time of training summed over runs (a resumed run starts a new segment)."""
    def t(e):
        return datetime.fromisoformat(e["time"].replace("Z", "+00:00")).timestamp()

    total, begin, end = 0.0, None, None
    for e in log:
        if e["event"] == "start":
            if begin is not None:
                total += end - begin
            begin = t(e)
        end = t(e)
    return (total + end - begin) / 60


def plot_usage(routing, png: Path):
    plt = pyplot()

    fig, axes = plt.subplots(len(routing), 1, figsize=(8, 1.3 * len(routing)), sharex=True)
    for ax, r in zip(axes, routing):
        total = sum(r["counts"])
        ax.bar(range(len(r["counts"])), [c / total for c in r["counts"]], color="tab:blue")
        ax.set_ylabel(f"layer {r['layer']}", fontsize=8)
        ax.axhline(1 / len(r["counts"]), color="gray", lw=0.5)
    axes[-1].set_xlabel("expert (share of routed slots; gray: uniform)")
    fig.tight_layout()
    fig.savefig(png, dpi=90)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", type=Path)
    p.add_argument("--pack", required=True, type=Path)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=32768)
    p.add_argument("--draft", action="store_true", help="the speculative draft's card")
    p.add_argument("--agent", type=Path, help="a train_agent_stage.py run: its section")
    p.add_argument("--assets", action="store_true",
                   help="rewrite only the section on the pack's heads, adapter, cache policy")
    args = p.parse_args()
    if args.assets:
        return update_assets(args.pack)
    if args.agent:
        return update_agent(args.agent, args.pack)
    if args.run is None:
        p.error("--run is required (or --assets)")
    if args.draft:
        return draft_card(args)

    text = (args.run / "heldout.txt").read_text()
    result = evaluate([ModelConfig(str(args.pack)), ModelConfig(str(args.run / "hf"))],
                      text, args.window, args.max_tokens, routing_stats=True)
    int4, fp32 = result["configs"]
    log = [json.loads(line) for line in (args.run / "train_log.jsonl").read_text().splitlines()]
    start = next(e for e in log if e["event"] == "start")
    last_eval = [e for e in log if e["event"] == "eval"][-1]
    tokens_seen = max(e.get("tokens_seen", 0) for e in log)
    config = json.loads((args.pack / "config.json").read_text())

    sample = make_sample(args.pack)
    rows = "\n".join(
        f"| {r['layer']} | {r['entropy_bits']:.2f} | {sum(c > 0 for c in r['counts'])}/"
        f"{len(r['counts'])} | {max(r['counts']) / sum(r['counts']):.1%} |"
        for r in result["routing"]
    )
    plot_usage(result["routing"], args.pack / "expert_usage.png")
    fine = config["num_experts"] > 32
    card = CARD.format(
        title="edgemoe fine-grained reference MoE" if fine else "edgemoe reference MoE",
        intro=(FINE_INTRO if fine else REFERENCE_INTRO).format(pack=args.pack),
        data=data_section(args.run), routing_stats=routing_stats_section(args.pack),
        shape_flag=" --shape fine" if fine else "", pack=args.pack,
        rebuild=f"MODEL={args.pack.name} scripts/rebuild_reference.sh",
        layers=config["num_hidden_layers"], hidden=config["hidden_size"],
        heads=config["num_attention_heads"], kv_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"], experts=config["num_experts"],
        top_k=config["num_experts_per_tok"], moe_ffn=config["moe_intermediate_size"],
        vocab=config["vocab_size"], context=config["max_position_embeddings"],
        params=start["params"]["total"], expert_frac=start["params"]["routed_frac"],
        pack_mb=sum(f.stat().st_size for f in args.pack.iterdir()) / 1e6,
        python=platform.python_version(), tokens=tokens_seen, train_tokens=start["train_tokens"],
        epochs=tokens_seen / start["train_tokens"], minutes=train_minutes(log),
        steps=max(e.get("step", 0) for e in log), fp32_mb=start["params"]["fp32_MB"],
        eval_tokens=result["tokens"], window=args.window,
        unigram=start["unigram_baseline"], unigram_ppl=math.exp(start["unigram_baseline"]),
        fp32_nll=fp32["nll"], fp32_ppl=fp32["perplexity"],
        int4_nll=int4["nll"], int4_ppl=int4["perplexity"],
        agree=result["top1_agreement"], kl=result["mean_kl"],
        max_bits=result["routing"][0]["max_entropy_bits"], routing_rows=rows, sample=sample,
        assets=assets_section(args.pack),
    )
    (args.pack / "README.md").write_text(card)
    (args.pack / "measurements.json").write_text(json.dumps(result, indent=1))
    print(card)
    print(f"last held-out eval during training: step {last_eval['step']}, "
          f"loss {last_eval['heldout_loss']:.3f}")


if __name__ == "__main__":
    main()
