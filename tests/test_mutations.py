"""The suite notices the breakages that matter: scripts/mutate.py breaks each on purpose
in a copy of the repository and runs the tests that should catch it."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_mutation_is_killed():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "mutate.py")],
                       capture_output=True, text=True, timeout=900)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("killed") == 5
