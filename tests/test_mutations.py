"""The suite notices the breakages that matter: scripts/mutate.py breaks each on purpose
in a copy of the repository and runs the tests that should catch it."""

import os
import subprocess
import sys
from pathlib import Path

from conftest import CHECKPOINTS_ENV

ROOT = Path(__file__).resolve().parents[1]


def test_every_mutation_is_killed(checkpoints):
    """The mutants' runs reuse this session's test checkpoints (built by transformers and
    mlx-lm, not by the package), rather than each building its own."""
    folder = checkpoints["qwen3_moe"][0].parent
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "mutate.py")],
                       capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, **{CHECKPOINTS_ENV: str(folder)}))
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("killed") == 5
