"""Tiny checkpoints of every supported family, built once per test session."""

import importlib
import os
import sys
from pathlib import Path

# Triton reads this when it is first imported, by whichever module imports it first: with
# no NVIDIA GPU its kernels run in its interpreter (test_cuda_backend)
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
# numpy's OpenBLAS, before numpy is first imported: one thread. The suite's numpy work
# (cache_sim's policy fits, replays) is small matrices, where a second thread only spins
# against MLX's threads and the other tests' processes: on two busy cores it cost 20x the
# CPU. MLX and torch bring their own BLAS and are unaffected.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# torch's OpenMP likewise (read when torch first loads, here or in a tool's subprocess):
# its models here are tiny, and each op's threads meet at a barrier, where on two busy
# cores a descheduled second thread made each op wait ~30x longer (test_lora's torch
# distillation: 15 ms a 32x64 matmul with two threads under load, 0.5 ms with one).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import make_test_checkpoints  # noqa: E402

from edgemoe.convert import convert  # noqa: E402

FAMILIES = make_test_checkpoints.DEFAULT_FAMILIES
HALF_FAMILIES = make_test_checkpoints.HALF_FAMILIES  # exactness tests only: slow on a CPU


CHECKPOINTS_ENV = "EDGEMOE_TEST_CHECKPOINTS"  # a folder of them built already: see below


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """family -> (Hugging Face folder, mlx-lm int4 folder). Where CHECKPOINTS_ENV names a
    folder that holds them (tests/test_mutations.py hands its session's to the mutants'
    runs), they are not built again."""
    out = os.environ.get(CHECKPOINTS_ENV) or tmp_path_factory.mktemp("checkpoints")
    return make_test_checkpoints.make_all(Path(out), FAMILIES + ["qwen3_moe_large"] + HALF_FAMILIES)


class Packs(dict):
    """family -> {"hf": pack converted from the HF layout, "mlx": from mlx-lm's int4}, each
    family converted when a test first asks for it: a run of a few tests converts a few."""

    def __init__(self, checkpoints, out: Path):
        super().__init__()
        self.checkpoints, self.out = checkpoints, out

    def __missing__(self, family):
        hf, mlx = self.checkpoints[family]
        self[family] = {"hf": convert(hf, self.out / f"{family}-from-hf"),
                        "mlx": convert(mlx, self.out / f"{family}-from-mlx")}
        return self[family]


@pytest.fixture(scope="session")
def packs(checkpoints, tmp_path_factory):
    return Packs(checkpoints, tmp_path_factory.mktemp("packs"))


def corrupt_record(pack_path, layer: int, expert: int):
    """Flip one byte inside a record of the pack's experts file; return that layer."""
    from edgemoe.format.pack import Pack

    pack = Pack.open(pack_path)
    pack_layer = pack.layers[layer]
    with open(pack.experts_path, "r+b") as f:
        f.seek(pack_layer.records[expert].offset + 100)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    return pack_layer


def tool_module(name):
    """The module `python -m edgemoe.NAME` runs."""
    return importlib.import_module(f"edgemoe.{name}")


def error_line(main, *argv) -> str:
    """A tool's exit message for an expected failure: one `edgemoe.X: error:` line."""
    with pytest.raises(SystemExit) as exit_:
        main(list(map(str, argv)))
    message = exit_.value.code
    assert isinstance(message, str) and message.startswith("edgemoe."), message
    assert ": error: " in message and "\n" not in message, message
    return message


@pytest.fixture(scope="session")
def tiny_mlx_checkpoint(tmp_path_factory):
    """The tiny Qwen3-MoE as mlx-lm writes it, alone (what the hub stand-in publishes:
    tests/test_hub.py, tests/test_readme.py)."""
    out = tmp_path_factory.mktemp("tiny-mlx")
    return make_test_checkpoints.make_all(out, ["qwen3_moe"])["qwen3_moe"][1]
