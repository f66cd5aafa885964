"""Conversion: same bits as mlx_lm.convert, aligned checksummed records, safe writes."""

import json
import os
import shutil
import zlib

import mlx.core as mx
import pytest

from edgemoe import convert as convert_module
from edgemoe.convert import convert
from edgemoe.format.families import UnsupportedModelError
from edgemoe.format.pack import ALIGNMENT, Pack

from conftest import FAMILIES


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_and_mlx_lm_sources_give_the_same_pack(family, packs, checkpoints):
    from_hf, from_mlx = packs[family]["hf"], packs[family]["mlx"]
    assert (from_hf / "experts.bin").read_bytes() == (from_mlx / "experts.bin").read_bytes()
    resident = mx.load(str(from_hf / "model.safetensors"))
    # the resident weights are mlx_lm.convert's own, minus the routed experts
    reference = mx.load(str(checkpoints[family][1] / "model.safetensors"))
    assert set(resident) == {k for k in reference if ".switch_mlp." not in k}
    for k, v in resident.items():
        assert mx.array_equal(v, reference[k]).item(), k


@pytest.mark.parametrize("family", FAMILIES)
def test_records_are_aligned_and_checksummed(family, packs):
    pack = Pack.open(packs[family]["hf"])
    data = pack.experts_path.read_bytes()
    assert len(data) % ALIGNMENT == 0
    for layer in pack.layers:
        assert layer.expert_bytes == sum(t.nbytes for t in layer.tensors)
        for r in layer.records:
            assert r.offset % ALIGNMENT == 0 and r.length == layer.expert_bytes
            assert zlib.crc32(data[r.offset:r.offset + r.length]) == r.crc32
    config = json.loads((pack.path / "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 64


def test_deepseek_keeps_shared_experts_and_dense_layers_resident(packs):
    pack = Pack.open(packs["deepseek_v3"]["hf"])
    assert [l.index for l in pack.layers] == [1, 2, 3]  # first_k_dense_replace = 1
    resident = mx.load(str(pack.path / "model.safetensors"))
    assert any(".shared_experts." in k for k in resident)
    assert any(k.endswith("e_score_correction_bias") for k in resident)


def test_resident_weights_in_shards_as_mlx_lm_saves_them(packs, checkpoints, tmp_path):
    """Resident weights over the shard limit go in shards with mlx-lm's names and index:
    the pack's tensors are the single file's, it loads, computes the same logits, and a
    damaged second shard is named by the verification."""
    import edgemoe
    from edgemoe.format.pack import PackError

    whole = packs["qwen3_moe"]["mlx"]
    dst = convert(checkpoints["qwen3_moe"][1], tmp_path / "sharded", max_shard_bytes=2**16)
    shards = sorted(dst.glob("model*.safetensors"))
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert len(shards) >= 2 and shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (dst / "model.safetensors").exists()
    assert set(index["weight_map"].values()) == {f.name for f in shards}
    found = {}
    for f in shards:
        found.update(mx.load(str(f)))
    expected = mx.load(str(whole / "model.safetensors"))
    assert set(found) == set(expected) == set(index["weight_map"])
    assert all(mx.array_equal(found[k], v).item() for k, v in expected.items())
    assert (dst / "experts.bin").read_bytes() == (whole / "experts.bin").read_bytes()
    prompt = mx.array([[1, 5, 9, 14]])
    logits = [edgemoe.load(p, expert_budget=0.5)[0](prompt) for p in (whole, dst)]
    assert mx.array_equal(*logits).item()
    data = bytearray(shards[1].read_bytes())
    data[-1] ^= 0xFF
    shards[1].write_bytes(bytes(data))
    with pytest.raises(PackError, match=f"{shards[1].name}: tensor .*checksum mismatch"):
        edgemoe.load(dst)


def test_refuses_to_overwrite_unless_asked(checkpoints, tmp_path):
    hf = checkpoints["mixtral"][0]
    dst = convert(hf, tmp_path / "pack")
    with pytest.raises(FileExistsError, match="--overwrite"):
        convert(hf, dst)
    convert(hf, dst, overwrite=True)
    Pack.open(dst)


def test_failed_conversion_leaves_nothing_behind(checkpoints, tmp_path, monkeypatch):
    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(convert_module, "_write_layer", fail)
    with pytest.raises(OSError, match="disk full"):
        convert(checkpoints["mixtral"][0], tmp_path / "pack")
    assert list(tmp_path.iterdir()) == []


def test_failed_overwrite_keeps_the_old_pack(checkpoints, tmp_path, monkeypatch):
    dst = convert(checkpoints["mixtral"][0], tmp_path / "pack")
    before = (dst / "experts.bin").read_bytes()
    monkeypatch.setattr(convert_module, "_write_layer", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        convert(checkpoints["mixtral"][0], dst, overwrite=True)
    assert (dst / "experts.bin").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pack"]


def test_a_model_without_routed_experts_is_refused_with_the_reason(checkpoints, tmp_path):
    src = tmp_path / "llama"
    shutil.copytree(checkpoints["mixtral"][0], src)
    config = json.loads((src / "config.json").read_text())
    config["model_type"] = "llama"
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="no routed experts") as e:
        convert(src, tmp_path / "out")
    assert "'llama'" in str(e.value)
    config["model_type"] = "no_such_family"
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="not a model mlx-lm 0.32.2 runs"):
        convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_source(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        convert(tmp_path / "nowhere", tmp_path / "out")


def test_convert_never_destroys_what_it_did_not_write(checkpoints, tmp_path):
    """The source, a folder around or inside it, a file, a folder that is not a pack:
    refused with the reason, and left as they were, even with --overwrite."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(checkpoints["mixtral"][0], src)
    before = sorted(p.name for p in src.iterdir())
    for dst, reason in ((src, "is the source"), (src / "pack", "is inside the source"),
                        (tmp_path, "contains the source")):
        with pytest.raises(ValueError, match=f"--mlx-path {dst}: {reason}"):
            convert(src, dst, overwrite=True)
    assert sorted(p.name for p in src.iterdir()) == before
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "mine.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not an edgemoe pack"):
        convert(src, notes, overwrite=True)
    afile = tmp_path / "afile"
    afile.write_text("keep me too")
    with pytest.raises(FileExistsError, match="not a folder"):
        convert(src, afile, overwrite=True)
    assert (notes / "mine.txt").read_text() == "keep me" and afile.read_text() == "keep me too"
    empty = tmp_path / "empty"
    empty.mkdir()
    Pack.open(convert(src, empty, overwrite=True))  # an empty folder may be filled


def test_leftovers_of_an_interrupted_run_are_reported_and_ours_only_removed(
        checkpoints, tmp_path, capsys):
    src = checkpoints["mixtral"][0]
    dst = tmp_path / "pack"
    partial = tmp_path / ".pack.partial"
    partial.mkdir()
    (partial / ".edgemoe-partial").touch()  # a run killed while writing
    Pack.open(convert(src, dst))
    assert "removing an interrupted conversion's leftovers" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pack"]
    someone = tmp_path / ".other.partial"
    someone.mkdir()
    (someone / "theirs.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not written by edgemoe.convert"):
        convert(src, tmp_path / "other")
    assert (someone / "theirs.txt").exists()


def test_a_second_convert_to_the_same_destination_is_refused_naming_the_holder(
        checkpoints, tmp_path):
    import subprocess
    import sys

    from conftest import error_line
    from edgemoe.format.destination import DestinationLock

    src, dst = checkpoints["mixtral"][0], tmp_path / "pack"
    with DestinationLock(dst):  # another convert at work
        line = error_line(convert_module.main, "--hf-path", src, "--mlx-path", dst)
    assert f"pid {os.getpid()}" in line and "another convert is writing this pack" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    # two processes at once: each ends with a whole pack or the one-line refusal, never
    # a success over a broken pack
    runs = [subprocess.Popen([sys.executable, "-m", "edgemoe.convert", "--hf-path", str(src),
                              "--mlx-path", str(dst), "--overwrite"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    for run in runs:
        out, err = run.communicate(timeout=300)
        if run.returncode:
            assert "another convert is writing this pack (pid" in err.strip().splitlines()[-1]
        else:
            assert "wrote" in out
    assert any(run.returncode == 0 for run in runs)
    from edgemoe.verify import main as verify_main
    verify_main(["--model", str(dst)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pack"]


def test_a_lock_taken_but_not_yet_signed_is_read_again_for_its_holder(tmp_path):
    """CI once saw "(another process)": the second convert read the lock in the moment
    between the holder's flock and its signature."""
    import fcntl
    import threading

    from edgemoe.format.destination import DestinationLock

    dst = tmp_path / "pack"
    with open(tmp_path / ".pack.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        sign = threading.Timer(0.3, lambda: (held.write("pid 4242 on host"), held.flush()))
        sign.start()
        with pytest.raises(FileExistsError, match=r"writing this pack \(pid 4242 on host\)"):
            DestinationLock(dst).__enter__()
        sign.join()


def test_overwrite_keeps_what_convert_did_not_write(checkpoints, tmp_path, capsys):
    src = checkpoints["mixtral"][0]
    dst = convert(src, tmp_path / "pack")
    (dst / "prerouter").mkdir()
    (dst / "prerouter" / "heads.safetensors").write_bytes(b"trained heads")
    (dst / "adapter").mkdir()
    (dst / "adapter" / "adapters.safetensors").write_bytes(b"trained adapter")
    (dst / "notes.txt").write_text("my notes")
    Pack.open(convert(src, dst, overwrite=True))
    assert (dst / "prerouter" / "heads.safetensors").read_bytes() == b"trained heads"
    assert (dst / "adapter" / "adapters.safetensors").read_bytes() == b"trained adapter"
    assert (dst / "notes.txt").read_text() == "my notes"
    err = capsys.readouterr().err
    assert "kept from the pack it replaced" in err and "prerouter/" in err and "notes.txt" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pack"]


def test_an_overwrite_cut_mid_swap_restores_the_old_pack(checkpoints, tmp_path):
    src = checkpoints["mixtral"][0]
    dst = convert(src, tmp_path / "pack")
    before = (dst / "experts.bin").read_bytes()
    dst.rename(tmp_path / ".pack.old")  # killed between moving the old pack aside and the new in
    with pytest.raises(FileExistsError, match="--overwrite"):
        convert(src, dst)  # the old pack is back in place first
    assert (dst / "experts.bin").read_bytes() == before


def test_a_pack_that_does_not_verify_is_never_reported_written(checkpoints, tmp_path,
                                                               monkeypatch):
    from edgemoe.format.pack import PackError
    from edgemoe.format.writer import ExpertsWriter

    write = ExpertsWriter.write

    def lossy(self, parts, crc=0):  # a disk that loses a write: the checksum is of the data
        record = write(self, parts, crc)
        self.file.flush()
        os.pwrite(self.file.fileno(), b"\xff", record.offset)
        return record

    monkeypatch.setattr(ExpertsWriter, "write", lossy)
    with pytest.raises(PackError, match="does not verify, so it was not put in place"):
        convert(checkpoints["mixtral"][0], tmp_path / "pack")
    assert list(tmp_path.iterdir()) == []
