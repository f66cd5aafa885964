"""Questions about the expert cache, asked of routing traces (edgemoe.generate --trace).

    python -m edgemoe.cache_sim replay TRACE [TRACE ...] --budget 0.1,0.25,0.5 \\
        [--policies lfu,learned,belady] [--prefetch] [--png hit_rate.png] [--json out.json]
    python -m edgemoe.cache_sim train-learned TRACE [TRACE ...] --out cache_policy.npz
    python -m edgemoe.cache_sim split TRACE [TRACE ...] --budget 0.1,0.25 [--policy lfu]
    python -m edgemoe.cache_sim windows TRACE [TRACE ...] --budget 0.1,0.25 --window 1,2,4,8

Each subcommand has its own --help; `replay` is the default (`cache_sim TRACE --budget 0.1`).

`replay` compares the cache policies with Belady's optimum: the traces replayed through
the store's own slots (edgemoe.whatif.replay). `train-learned` fits the weights of the
learned policy, which is experimental (edgemoe.whatif.experimental). `split` asks whether
one budget shared across layers beats the even split the store uses; `windows`, what
speculative decoding can save in reads at best (edgemoe.whatif.questions).

This module is the command line of the what-if room (edgemoe.whatif): a tool, like doctor.
"""

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import List

from .cli import add_debug_flag, tool
from .options import experimental_group
from .streaming.cache import DEFAULT_POLICY, POLICIES
from .streaming.trace import load_trace
from .whatif.experimental.fit_learned import train_learned
from .whatif.experimental.learned import DEFAULT_LEARNED, NextUseModel
from .whatif.questions import compare_split, compare_windows
from .whatif.replay import Result, run, trace_experts


def plot(results: List[Result], path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for policy in dict.fromkeys(r.policy for r in results):
        rows = [r for r in results if r.policy == policy]
        ax.plot([r.slots for r in rows], [r.decode_hit_rate for r in rows], marker="o",
                label=policy, linestyle="--" if policy == "belady" else "-")
    ax.set_xlabel("expert slots per layer (the budget)")
    ax.set_ylabel("decode hit rate")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_table(results: List[Result]):
    belady = {r.budget: r for r in results if r.policy == "belady"}
    print(f"{'budget':>7} {'slots':>5} {'policy':>8} {'hit rate':>9} {'decode hit':>10} "
          f"{'MB read/decode token':>21} {'vs Belady':>10}")
    for r in results:
        best = belady.get(r.budget)
        gap = f"{100 * (r.decode_hit_rate - best.decode_hit_rate):+.1f} pt" if best else ""
        per_token = r.decode_bytes_read / max(r.decode_tokens, 1) / 1e6
        print(f"{r.budget:>7} {r.slots:>5} {r.policy:>8} {r.hit_rate:>9.1%} "
              f"{r.decode_hit_rate:>10.1%} {per_token:>21.3f} {gap:>10}")


SUBCOMMANDS = ("replay", "split", "windows", "train-learned")


def build_parser() -> argparse.ArgumentParser:
    """`python -m edgemoe.cache_sim COMMAND ...`: one subcommand per question, each with
    its own --help. Without a subcommand the arguments are `replay`'s, as they were before
    there were subcommands (`cache_sim TRACE.npz --budget 0.1`)."""
    p = argparse.ArgumentParser(
        prog=sys.argv[0] if sys.argv[0].startswith("edgemoe ") else "python -m edgemoe.cache_sim",
        description="Replay routing traces (edgemoe.generate --trace) through the store's "
                    "expert slots: cache policies against Belady's optimum, a budget split "
                    "across layers, speculative windows; fit the learned policy.",
        epilog="Without a subcommand, replay: python -m edgemoe.cache_sim TRACE.npz "
               "--budget 0.1,0.25")
    add_debug_flag(p)
    sub = p.add_subparsers(dest="command", title="subcommands", metavar="COMMAND")
    replay = sub.add_parser(
        "replay", help="decode hit rates and bytes of each cache policy and Belady's optimum",
        description="Replay routing traces through expert cache policies and Belady's "
                    "optimum.", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    replay.add_argument("traces", nargs="+", help=".npz traces from `edgemoe.generate --trace`")
    replay.add_argument("--budget", default="0.1,0.25,0.5",
                        help="Comma-separated expert budgets: fractions, percentages or sizes")
    replay.add_argument("--policies", default=None,
                        help=f"Comma-separated, of {', '.join(POLICIES)}, belady "
                             f"(default: all; learned only if its weights exist)")
    replay.add_argument("--num-experts", type=int, default=None,
                        help="Experts per layer (default: as the traces record)")
    replay.add_argument("--prefetch", action="store_true",
                        help="Also replay the prefetches the traces recorded (advisory or "
                             "prerouted runs); Belady is then left out")
    replay.add_argument("--png", default=None,
                        help="Plot decode hit rate against budget here (needs matplotlib: "
                             "pip install 'edgemoe[bench]')")
    replay.add_argument("--json", default=None, help="Write the results here")
    add_debug_flag(replay)
    experimental_group(replay, "--policies learned: the learned policy "
                               "(edgemoe.whatif.experimental).").add_argument(
        "--learned", default=str(DEFAULT_LEARNED), help="Learned policy weights")
    replay.set_defaults(run=main_replay)

    split = sub.add_parser(
        "split", help="would one budget shared across layers beat the even split?",
        description="Fit a split of the slots across layers to half of the traces; replay "
                    "the other half with it and with the even split.")
    _replay_flags(split)
    split.set_defaults(run=main_split)

    windows = sub.add_parser(
        "windows", help="decode bytes per token in speculative windows, every draft kept",
        description="Decode bytes per token were the traces' decoded tokens verified in "
                    "speculative windows, every draft kept: the best a draft can do for "
                    "reads.")
    _replay_flags(windows)
    windows.add_argument("--window", default="1,2,3,4,6,8", help="tokens per window")
    windows.set_defaults(run=main_windows)

    train = sub.add_parser(
        "train-learned", help="experimental: fit the learned cache policy's weights",
        description="Fit the learned cache policy to Belady's next-use distances on routing "
                    "traces.")
    train.add_argument("traces", nargs="+")
    train.add_argument("--out", default=str(DEFAULT_LEARNED))
    train.add_argument("--hidden", type=int, default=16)
    train.add_argument("--steps", type=int, default=2000)
    add_debug_flag(train)
    train.set_defaults(run=main_train)
    return p


def _replay_flags(p: argparse.ArgumentParser):
    """The flags `split` and `windows` share."""
    p.add_argument("traces", nargs="+")
    p.add_argument("--budget", default="0.1,0.25")
    p.add_argument("--policy", default=DEFAULT_POLICY,
                   choices=[n for n in POLICIES if n != "learned"])
    p.add_argument("--json", default=None, help="Write the results here")
    add_debug_flag(p)


@tool("cache_sim")
def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and argv[0] not in SUBCOMMANDS and not argv[0].startswith("-"):
        argv = ["replay"] + argv  # the invocation from before the subcommands
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        parser.exit(2)
    return args.run(args)


def main_replay(args):
    traces = [load_trace(t) for t in args.traces]
    if args.policies:
        policies = args.policies.split(",")
    else:
        policies = [n for n in POLICIES if n != "learned" or Path(args.learned).exists()]
        if not args.prefetch:
            policies.append("belady")
    unknown = set(policies) - set(POLICIES) - {"belady"}
    if unknown:
        raise ValueError(f"cache policy {', '.join(sorted(unknown))}: choose from "
                         f"{', '.join(POLICIES)}, belady")
    model = NextUseModel.load(args.learned) if "learned" in policies else None
    results = run(traces, args.budget.split(","), policies, args.num_experts, model,
                  args.prefetch)
    n = sum(len(t["routed"]) for t in traces)
    d = sum(int(t["decode"].sum()) for t in traces)
    experts = args.num_experts or max(trace_experts(t) for t in traces)
    print(f"{len(traces)} traces, {n} tokens ({d} decoded), {experts} experts per layer, "
          f"top-{traces[0]['routed'].shape[-1]}" + (", prefetches replayed" if args.prefetch
                                                    else ""))
    print_table(results)
    if args.json:  # before the plot, which needs an optional package
        rows = [dict(asdict(r), hit_rate=r.hit_rate, decode_hit_rate=r.decode_hit_rate)
                for r in results]
        Path(args.json).write_text(json.dumps(rows, indent=1))
        print(f"wrote {args.json}")
    if args.png:
        try:
            plot(results, args.png)
        except ImportError:
            sys.exit("edgemoe.cache_sim: error: --png needs matplotlib: "
                     "pip install 'edgemoe[bench]'")
        print(f"wrote {args.png}")


def main_train(args):
    traces = [load_trace(t) for t in args.traces]
    model = train_learned(traces, hidden=args.hidden, steps=args.steps)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    model.save(args.out)
    print(f"wrote {args.out} (trained on {len(traces)} traces)")


def main_split(args):
    traces = [load_trace(t) for t in args.traces]
    rows = [compare_split(traces, b, args.policy) for b in args.budget.split(",")]
    print(f"fitted on {rows[0]['fit_traces']} traces, replayed on {rows[0]['held_out_traces']} "
          f"others ({args.policy})")
    print(f"{'budget':>7} {'even slots':>10} {'fitted split':>24} {'KB/token even':>14} "
          f"{'KB/token fitted':>16} {'ratio':>6}")
    for r in rows:
        print(f"{r['budget']:>7} {r['even_slots']:>10} {str(r['split']):>24} "
              f"{r['even_bytes_per_token'] / 1e3:>14.1f} {r['fitted_bytes_per_token'] / 1e3:>16.1f} "
              f"{r['fitted_bytes_per_token'] / max(r['even_bytes_per_token'], 1):>6.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
        print(f"wrote {args.json}")


def main_windows(args):
    traces = [load_trace(t) for t in args.traces]
    windows = [int(w) for w in args.window.split(",")]
    rows = [r for b in args.budget.split(",")
            for r in compare_windows(traces, b, windows, args.policy)]
    print(f"{len(traces)} traces, {sum(int(t['decode'].sum()) for t in traces)} decoded "
          f"tokens ({args.policy}); every draft kept")
    print(f"{'budget':>7} {'slots':>5} {'window':>6} {'KB/token':>9} {'vs plain':>8}")
    for r in rows:
        print(f"{r['budget']:>7} {r['slots']:>5} {r['window']:>6} "
              f"{r['bytes_per_token'] / 1e3:>9.1f} {r['ratio_to_plain']:>8.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
