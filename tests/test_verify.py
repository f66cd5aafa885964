"""`edgemoe.verify`: a pack checked whole; an mlx-lm checkpoint read in place indexed once,
after which its weights are checked at load and as they are read, as a pack's are."""

import json
import shutil
import struct

import mlx.core as mx
import pytest

import edgemoe
from edgemoe.format.checksums import INDEX_FILE
from edgemoe.format.pack import PackError
from edgemoe.format.source import open_source
from edgemoe.mlx_backend.families import find_experts

from conftest import corrupt_record, error_line, tool_module

FAMILY = "qwen3_moe"
verify, generate = tool_module("verify"), tool_module("generate")
TOKENS = mx.array([[5, 77, 300, 12, 9, 41]])


def flip_byte(path, tensor: str, at: int):
    """Flip the byte `at` bytes into `tensor` of a safetensors file."""
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        start = 8 + n + json.loads(f.read(n))[tensor]["data_offsets"][0]
        f.seek(start + at)
        byte = f.read(1)
        f.seek(start + at)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.fixture
def in_place(checkpoints, tmp_path):
    return shutil.copytree(checkpoints[FAMILY][1], tmp_path / "mlx")


def logits(path, **kw):
    model, _ = edgemoe.load(path, expert_budget=1.0, **kw)
    out = model(TOKENS)
    mx.eval(out)
    model.expert_store.close()
    return out


def test_an_indexed_checkpoint_is_verified_and_still_exact(in_place, capsys):
    unindexed = logits(in_place)
    assert "not verified" in capsys.readouterr().err
    verify.main(["--model", str(in_place)])
    assert f"wrote {in_place / INDEX_FILE}" in capsys.readouterr().out
    source = open_source(in_place, find_experts=find_experts)
    assert all(r.crc32 is not None for l in source.layers for r in l.records)
    indexed = logits(in_place)
    assert "not verified" not in capsys.readouterr().err
    assert mx.array_equal(indexed, unindexed)  # checking changes nothing
    verify.main(["--model", str(in_place)])  # a second run checks against the index
    assert "ok (" in capsys.readouterr().out


def test_corruption_in_place_is_found_once_indexed(in_place):
    verify.main(["--model", str(in_place)])
    layer = open_source(in_place, find_experts=find_experts).layers[0]
    tensor = f"{layer.module}.up_proj.weight"
    per_expert = next(t.nbytes for t in layer.tensors if t.name == "up_proj.weight")
    for e in range(layer.num_experts):  # whichever the routing picks is corrupt
        flip_byte(in_place / "model.safetensors", tensor, e * per_expert + 10)
    with pytest.raises(PackError, match=rf"layer {layer.index} expert \d+: checksum mismatch"):
        logits(in_place)  # read as the model computes
    assert f"layer {layer.index} expert 0: checksum mismatch" in error_line(
        verify.main, "--model", in_place)
    for e in range(layer.num_experts):  # undo
        flip_byte(in_place / "model.safetensors", tensor, e * per_expert + 10)
    flip_byte(in_place / "model.safetensors", "model.norm.weight", 0)
    with pytest.raises(PackError, match="tensor model.norm.weight: checksum mismatch"):
        edgemoe.load(in_place)  # a resident tensor: at load
    logits(in_place, verify=False)  # --no-verify reads it unchecked


def test_a_replaced_shard_makes_the_index_stale_until_rebuilt(in_place):
    verify.main(["--model", str(in_place)])
    weights = mx.load(str(in_place / "model.safetensors"))
    mx.save_safetensors(str(in_place / "model.safetensors"), weights,
                        metadata={"format": "mlx", "note": "re-saved"})  # a new header
    message = error_line(generate.main, "--model", in_place, "-m", 1)
    assert "model.safetensors changed since the index was built" in message
    assert "--rebuild" in message
    verify.main(["--model", str(in_place), "--rebuild"])
    logits(in_place)


def test_a_pack_is_verified_whole(packs, tmp_path, capsys):
    pack = shutil.copytree(packs[FAMILY]["hf"], tmp_path / "pack")
    verify.main(["--model", str(pack)])  # returns: exit status 0
    assert "ok (" in capsys.readouterr().out
    layer = corrupt_record(pack, 2, 3)
    assert f"layer {layer.index} expert 3: checksum mismatch" in error_line(
        verify.main, "--model", pack)
