"""The README's test command from a clone placed anywhere: a clone in an empty temporary
folder (nothing beside it, no shared folder above it) runs the tests that once reached outside the
repository (the cgroup helper, the README's links), with the clone's own code."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUBSET = ["tests/test_constrained.py", "tests/test_cli.py",
          "tests/test_auto_budget.py::test_available_memory_follows_a_memory_cgroup",
          "tests/test_readme.py::test_no_text_refers_outside_the_repository",
          "tests/test_readme.py::test_every_block_is_one_a_test_runs"]


def test_a_clone_in_an_empty_folder_runs_the_tests(tmp_path):
    clone = tmp_path / "edgemoe"
    r = subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(ROOT), str(clone)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot clone this checkout: {r.stderr.strip()[-200:]}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["edgemoe"]
    where = subprocess.run([sys.executable, "-c", "import edgemoe; print(edgemoe.__file__)"],
                           cwd=clone, capture_output=True, text=True)
    assert Path(where.stdout.strip()).is_relative_to(clone), where.stdout  # the clone's code
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        *SUBSET], cwd=clone, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout
