"""Tiny checkpoints of every supported family, built once per test session."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import make_test_checkpoints  # noqa: E402

from edgemoe.convert import convert  # noqa: E402

FAMILIES = make_test_checkpoints.DEFAULT_FAMILIES


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """family -> (Hugging Face folder, mlx-lm int4 folder)."""
    out = tmp_path_factory.mktemp("checkpoints")
    return make_test_checkpoints.make_all(out, FAMILIES + ["qwen3_moe_large"])


@pytest.fixture(scope="session")
def packs(checkpoints, tmp_path_factory):
    """family -> {"hf": pack converted from the HF layout, "mlx": from mlx-lm's int4}."""
    out = tmp_path_factory.mktemp("packs")
    result = {}
    for family, (hf, mlx) in checkpoints.items():
        result[family] = {
            "hf": convert(hf, out / f"{family}-from-hf"),
            "mlx": convert(mlx, out / f"{family}-from-mlx"),
        }
    return result
