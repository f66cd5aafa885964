"""Instructions the decoding thread executes per MoE layer, edgemoe's over mlx-lm's (#50): a
figure that the machine's noise cannot move, beside bench_hotpath's main-thread CPU.

    python scripts/hotpath_instructions.py [--model edgemoe/models/fine] [--budgets 50%]
           [--tokens 8,24] [--out DIR]

Each configuration (mlx-lm's model, then edgemoe at each budget) runs in a process of its own
under valgrind's callgrind (`--separate-threads=yes`), which counts the instructions each
thread executes. A process loads the model, warms it with a short decode, then decodes the
same prompt greedily (mlx-lm's `generate_step`); two processes per configuration decode N1
and N2 tokens, and the difference of their counts is N2 - N1 tokens of decode alone (the
imports, the load and the prefill cancel). `PYTHONHASHSEED` is fixed, so that both do the
same work. Reported per decoded token and per MoE layer over mlx-lm's:

- the decoding thread (the process's first): the host's work, and the part of it in
  libpython, Python itself (the interpreter's own functions; C++ helpers that several
  libraries carry, such as std::string's, are put down to one library or another from one
  run to the next, so no other library's share is told);
- every other thread: MLX's compute, and edgemoe's readers.

Run to run, on the same code, the decoding thread's count moves by up to ~10%: how often a
waiting thread polls depends on the threads' timing, even under valgrind.

Instructions are not time: on these machines the same Python costs 2-3 times more right
after an evaluation (docs/benchmarks.md, sessions 33-35), which this count does not see. It
tells what a change removes, exactly, where a timing needs many rounds to. Needs valgrind
(`apt install valgrind`); two configurations take about 5 minutes on 2 cores. Writes
DIR/hotpath_instructions.json, and callgrind's files in DIR/callgrind (`callgrind_annotate`
reads them: DIR/callgrind/callgrind.50.24-01 is the decoding thread of the 50% budget's
24-token run).
"""

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPT = Path(__file__).resolve()
LIBRARY = re.compile(r"\[([^\]]+)\]\s*$")  # callgrind_annotate's "[object file]" of a line


def decode_child(model: Path, config: str, tokens: int, prompt: int):
    """The process callgrind runs: load `config` ("mlx-lm" or a budget), warm it, decode."""
    import resource

    real_setrlimit = resource.setrlimit

    def setrlimit(which, limits):  # valgrind keeps file descriptors of its own, so mlx-lm's
        try:  # raise of the open-file limit fails under it: not this count's concern
            real_setrlimit(which, limits)
        except ValueError:
            pass

    resource.setrlimit = setrlimit
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load as mlx_lm_load

    import edgemoe

    sys.path.insert(0, str(SCRIPT.parent))
    from bench_hotpath import ROOT, mlx_lm_folder

    with tempfile.TemporaryDirectory(prefix="hotpath_instructions-") as scratch:
        if config == "mlx-lm":
            model_, tokenizer = mlx_lm_load(str(mlx_lm_folder(model, Path(scratch))))
        else:
            model_, tokenizer = edgemoe.load(model, expert_budget=config)
        ids = mx.array(tokenizer.encode((ROOT / "README.md").read_text())[:prompt])
        for _ in generate_step(ids, model_, max_tokens=4):  # warm
            pass
        for _ in generate_step(ids, model_, max_tokens=tokens):
            pass


def thread_counts(out: Path) -> list:
    """Instructions per thread of one callgrind run (its files out-01, out-02, ...), the
    process's first thread first."""
    files = sorted(out.parent.glob(out.name + "-*"), key=lambda f: int(f.name.rsplit("-", 1)[1]))
    counts = []
    for f in files:
        found = re.search(r"^(?:summary|totals): (\d+)", f.read_text(errors="replace"), re.M)
        counts.append(int(found.group(1)) if found else 0)
    return counts


def python_share(out: Path) -> int:
    """The first thread's instructions in libpython (callgrind_annotate, self cost)."""
    text = subprocess.run(["callgrind_annotate", "--threshold=100", f"{out}-01"],
                          capture_output=True, text=True, check=True).stdout
    total = 0
    for line in text.splitlines():
        count = re.match(r"\s*([\d,]+)\s", line)
        library = LIBRARY.search(line)
        if count and library and Path(library.group(1)).name.startswith("libpython"):
            total += int(count.group(1).replace(",", ""))
    return total


def run_one(args, config: str, tokens: int, scratch: Path) -> Path:
    out = scratch / f"callgrind.{config.rstrip('%')}.{tokens}"
    env = dict(os.environ, PYTHONHASHSEED="0")
    subprocess.run(["valgrind", "--tool=callgrind", "--separate-threads=yes",
                    f"--callgrind-out-file={out}", sys.executable, str(SCRIPT), "--child",
                    config, str(tokens), "--model", str(args.model), "--prompt", str(args.prompt)],
                   env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def measure(args) -> dict:
    from edgemoe.format.source import open_source
    from edgemoe.mlx_backend.families import find_experts

    layers = len(open_source(args.model, verify=False, find_experts=find_experts).layers)
    configs = ["mlx-lm", *args.budgets]
    n1, n2 = args.tokens
    files = args.out / "callgrind"
    files.mkdir(parents=True, exist_ok=True)
    for old in files.glob("callgrind.*"):  # an earlier run's (a run writes a file a thread)
        old.unlink()
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        runs = {(c, n): pool.submit(run_one, args, c, n, files)
                for c in configs for n in (n1, n2)}
        outs = {key: run.result() for key, run in runs.items()}
        rows = {}
        for c in configs:
            short, long = thread_counts(outs[c, n1]), thread_counts(outs[c, n2])
            decoded = n2 - n1
            rows[c] = {"main_per_token": (long[0] - short[0]) / decoded,
                       "python_per_token": (python_share(outs[c, n2])
                                            - python_share(outs[c, n1])) / decoded,
                       "others_per_token": (sum(long[1:]) - sum(short[1:])) / decoded}
    base = rows["mlx-lm"]
    for c in args.budgets:
        for part in ("main", "python", "others"):
            rows[c][f"{part}_over_mlx_lm_per_moe_layer"] = \
                (rows[c][f"{part}_per_token"] - base[f"{part}_per_token"]) / layers
    return {"model": str(args.model), "moe_layers": layers, "tokens": args.tokens,
            "prompt_tokens": args.prompt, "rows": rows, "command": " ".join(sys.argv)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--budgets", default="50%")
    p.add_argument("--tokens", default="8,24", help="N1,N2: the two decodes (N2 > N1)")
    p.add_argument("--prompt", type=int, default=48)
    p.add_argument("--out", type=Path, default=Path("runs/hotpath_instructions"))
    p.add_argument("--child", nargs=2, metavar=("CONFIG", "TOKENS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.model is None:
        from edgemoe.format.source import BUNDLED_MODEL

        args.model = Path(BUNDLED_MODEL)
    if args.child:
        decode_child(args.model, args.child[0], int(args.child[1]), args.prompt)
        return
    for tool in ("valgrind", "callgrind_annotate"):
        if shutil.which(tool) is None:
            sys.exit(f"hotpath_instructions: needs {tool} (apt install valgrind), "
                     f"not found on PATH")
    args.budgets = args.budgets.split(",")
    args.tokens = [int(t) for t in args.tokens.split(",")]
    if len(args.tokens) != 2 or args.tokens[1] <= args.tokens[0]:
        sys.exit(f"hotpath_instructions: --tokens: expected N1,N2 with N2 > N1, "
                 f"found {','.join(map(str, args.tokens))}")
    result = measure(args)
    (args.out / "hotpath_instructions.json").write_text(json.dumps(result, indent=1))
    print("instructions a decoded token (and over mlx-lm's, a MoE layer): the decoding "
          "thread, its Python, the other threads")
    for c, r in result["rows"].items():
        print(f"{c:>8} " + "  ".join(
            f"{r[f'{part}_per_token']:12,.0f}"
            + (f" ({r[f'{part}_over_mlx_lm_per_moe_layer']:+9,.0f})" if c != "mlx-lm" else "")
            for part in ("main", "python", "others")))


if __name__ == "__main__":
    main()
