"""Break what matters on purpose and check that a test notices.

    python scripts/mutate.py [--only NAME ...]

Each mutation changes one line of the package in a copy of the repository (the files git
tracks), then runs the tests that should catch it there. A mutation is *killed* when
those tests fail; one that survives means the suite cannot see that breakage. Exits 1 if
any survives. tests/test_mutations.py runs this in CI.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Mutation:
    name: str
    path: str  # in the repository
    old: str
    new: str
    tests: list  # pytest arguments


MUTATIONS = [
    Mutation("LFU evicts the most used", "edgemoe/streaming/cache.py",
             "return min(candidates, key=self._key.__getitem__, default=None)",
             "return max(candidates, key=self._key.__getitem__, default=None)",
             ["tests/test_cache.py", "-k", "lfu"]),
    Mutation("LFU breaks ties by the most recent", "edgemoe/streaming/cache.py",
             "key[expert] = ((key.get(expert, 0) >> 40) + 1) << 40 | clock  # (clock < 2**40)",
             "key[expert] = ((key.get(expert, 0) >> 40) + 1) << 40 | (1 << 40) - clock",
             ["tests/test_cache.py", "tests/test_store.py", "-k", "lfu"]),
    Mutation("prefetches counted as misses", "edgemoe/streaming/stats.py",
             "return self.hits + self.late_fills + self.on_demand",
             "return self.hits + self.late_fills + self.on_demand + self.prefetches",
             ["tests/test_store.py", "-k", "by_value"]),
    Mutation("record checksums not checked", "edgemoe/streaming/reads.py",
             "if crc is not None:", "if False:",
             ["tests/test_store.py", "-k", "corrupt"]),
    Mutation("a failed compute keeps its slots", "edgemoe/streaming/calls.py",
             "            if not (held and done):  # (a failed call releases at once)",
             "            if not held:",
             ["tests/test_core.py", "-k", "exception"]),
]


def tracked_copy(dst: Path):
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)


def run(m: Mutation) -> dict:
    with tempfile.TemporaryDirectory(prefix="edgemoe-mutant-") as tmp:
        copy = Path(tmp)
        tracked_copy(copy)
        target = copy / m.path
        source = target.read_text()
        if source.count(m.old) != 1:
            return {"name": m.name, "status": "stale", "detail": f"{m.path}: the line to "
                    f"change is not there once ({source.count(m.old)} times)"}
        target.write_text(source.replace(m.old, m.new))
        env = dict(os.environ, PYTHONPATH=str(copy))  # the mutant, not the installed copy
        tic = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                            *m.tests], cwd=copy, env=env, capture_output=True, text=True)
        summary = (r.stdout.strip().splitlines() or [""])[-1]
        status = "killed" if r.returncode == 1 else "survived" if r.returncode == 0 else "error"
        return {"name": m.name, "status": status, "detail": summary,
                "seconds": round(time.perf_counter() - tic, 1)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="*", default=None, help="Mutation names to run")
    args = p.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    with ThreadPoolExecutor(2) as pool:  # each in its own copy: two at a time
        results = list(pool.map(run, chosen))
    for r in results:
        print(f"{r['status']:>8}  {r['name']}: {r['detail']}", flush=True)
    return 0 if all(r["status"] == "killed" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
