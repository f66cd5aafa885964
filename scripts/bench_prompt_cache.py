"""Time to first token of a replayed 3-turn Claude Code session, with the prompt cache on
disk: turn 1 prefills its whole prompt, turns 2 and 3 only their new tokens, and after a
server restart every turn reads its prefix from disk.

    PYTHONPATH=. python scripts/bench_prompt_cache.py [--chars 420] [--rounds 2] \\
        [--out docs/images/prompt_cache]

The turns are Claude Code 2.1.332's recorded requests (tests/data/agents), their long texts
cut (`--chars`) so the longest fits the bundled model's 2,048-token context. Each round
runs under its own API key, so its turn 1 is cold (the default scope, per key); rounds
alternate with the restarted server's, which replays the same keys from disk. TTFT: from
sending the streamed request to its first event (message_start, sent with the first
token). Writes JSON and a picture; medians over the rounds.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anthropic

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))
from agent_requests import claude_code, fit, split  # noqa: E402
from test_agents import serving  # noqa: E402
from plotting import pyplot  # noqa: E402


def session_ttft(url: str, key: str, chars: int):
    """[(prompt tokens, cached tokens, seconds to the first event)] of the 3 turns."""
    client = anthropic.Anthropic(base_url=url, api_key=key, timeout=600, max_retries=0)
    out = []
    for r in claude_code():
        known, extra = split(fit(r["body"], chars=chars, max_tokens=1),
                             client.beta.messages.stream)
        start = time.perf_counter()
        with client.beta.messages.stream(**known, extra_body=extra) as stream:
            first = None
            for event in stream:
                if first is None:
                    first = time.perf_counter() - start
                    usage = event.message.usage
        out.append((usage.input_tokens, usage.cache_read_input_tokens, first))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chars", type=int, default=420)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "docs" / "images" / "prompt_cache"))
    args = p.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="edgemoe-kv-"))
    runs = {"fresh": [], "restarted": []}
    for r in range(args.rounds):
        key = f"round-{r}"
        with serving("--prompt-cache-dir", str(folder)) as (url, _):
            runs["fresh"].append(session_ttft(url, key, args.chars))
        with serving("--prompt-cache-dir", str(folder)) as (url, _):
            runs["restarted"].append(session_ttft(url, key, args.chars))
        print(f"round {r}: fresh {runs['fresh'][-1]}\n         restarted "
              f"{runs['restarted'][-1]}", flush=True)
    result = {"chars": args.chars, "rounds": args.rounds, "runs": runs, "medians": {}}
    cold = statistics.median(run[0][2] for run in runs["fresh"])
    for name, rounds in runs.items():
        ttft = [statistics.median(run[t][2] for run in rounds) for t in range(3)]
        result["medians"][name] = {"prompt_tokens": [rounds[0][t][0] for t in range(3)],
                                   "cached_tokens": [rounds[0][t][1] for t in range(3)],
                                   "ttft_s": ttft,
                                   "speedup_vs_cold_turn_1": [cold / s for s in ttft]}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    picture(result, out.with_suffix(".png"))
    print(json.dumps(result["medians"], indent=1))


def picture(result: dict, path: Path):
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 3.2))
    width = 0.38
    for i, (name, m) in enumerate(result["medians"].items()):
        xs = [t + (i - 0.5) * width for t in range(3)]
        bars = ax.bar(xs, m["ttft_s"], width, label=f"{name} server")
        for bar, tokens, cached in zip(bars, m["prompt_tokens"], m["cached_tokens"]):
            ax.annotate(f"{cached}/{tokens}", (bar.get_x() + bar.get_width() / 2,
                                               bar.get_height()),
                        ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(3), ["turn 1", "turn 2", "turn 3"])
    ax.set_ylabel("time to first token (s)")
    ax.set_title("Claude Code session, bundled model (cached/prompt tokens)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
