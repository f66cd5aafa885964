"""Every expected failure of a tool is one line naming the file or field, and exit status 1;
tracebacks are for bugs, or asked for with --debug (edgemoe.cli)."""

import errno
import json
import shutil

import mlx.core as mx
import pytest

from edgemoe.format.pack import EXPERTS_FILE, MANIFEST, Pack, PackError
from edgemoe.streaming import reads as reads_module

from conftest import corrupt_record, error_line, tool_module

FAMILY = "qwen3_moe"


cache_sim, convert, doctor, generate, server = map(
    tool_module, ("cache_sim", "convert", "doctor", "generate", "server"))


@pytest.fixture
def pack(packs, tmp_path):
    """A copy of a pack, to damage."""
    return shutil.copytree(packs[FAMILY]["hf"], tmp_path / "pack")


def edit_manifest(pack, change):
    m = json.loads((pack / MANIFEST).read_text())
    change(m)
    (pack / MANIFEST).write_text(json.dumps(m))


def test_a_manifest_missing_a_field_is_named_by_every_tool(pack):
    edit_manifest(pack, lambda m: m.pop("top_k"))
    for main in (generate.main, doctor.main, server.main):
        message = error_line(main, "--model", pack)
        assert f"{pack / MANIFEST}: missing field 'top_k'" in message


def test_a_record_out_of_place_is_named_at_load(pack):
    edit_manifest(pack, lambda m: m["layers"][1]["records"][5].__setitem__(0, 8 + m["layers"][
        1]["records"][5][0]))
    message = error_line(generate.main, "--model", pack, "--io", "direct", "-m", 1)
    assert "layer 1 expert 5: record offset" in message and "not 16384-byte aligned" in message
    edit_manifest(pack, lambda m: m["layers"][0]["records"][-1].__setitem__(0, m[
        "experts_file_size"]))
    assert "past the experts file" in error_line(generate.main, "--model", pack)


def test_a_pack_without_its_manifest_is_called_a_broken_pack(pack):
    (pack / MANIFEST).unlink()
    message = error_line(generate.main, "--model", pack)
    assert "an edgemoe pack without its manifest.json" in message
    assert "switch_mlp" not in message


def split_into_shards(src, dst):
    """An mlx-lm checkpoint whose weights lie in two shards named by an index."""
    shutil.copytree(src, dst)
    weights = mx.load(str(dst / "model.safetensors"))
    names = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": names[:len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, part in halves.items():
        mx.save_safetensors(str(dst / shard), {n: weights[n] for n in part},
                            metadata={"format": "mlx"})
    (dst / "model.safetensors").unlink()
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: s for s, part in halves.items() for n in part}}))
    return dst


def test_a_missing_shard_is_named(checkpoints, tmp_path):
    hf = shutil.copytree(checkpoints[FAMILY][0], tmp_path / "hf")
    shard = sorted(hf.glob("model-*.safetensors"))[1]
    shard.unlink()
    expected = f"{shard}: missing (named by model.safetensors.index.json)"
    assert expected in error_line(convert.main, "--hf-path", hf, "--mlx-path", tmp_path / "o")
    assert not (tmp_path / "o").exists()

    in_place = split_into_shards(checkpoints[FAMILY][1], tmp_path / "mlx")
    (in_place / "model-00002-of-00002.safetensors").unlink()
    assert f"{in_place / 'model-00002-of-00002.safetensors'}: missing" in error_line(
        generate.main, "--model", in_place, "-m", 1)


def test_a_sharded_checkpoint_read_in_place_still_streams(checkpoints, tmp_path):
    """The shard check passes a whole sharded checkpoint (the guard must not refuse it)."""
    in_place = split_into_shards(checkpoints[FAMILY][1], tmp_path / "mlx")
    generate.main(["--model", str(in_place), "-m", "3", "--verbose", "false"])


def test_a_full_disk_during_convert_is_one_line_and_leaves_nothing(checkpoints, tmp_path,
                                                                   monkeypatch):
    def full(self, parts):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.file.name))

    monkeypatch.setattr(convert.ExpertsWriter, "write", full)
    message = error_line(convert.main, "--hf-path", checkpoints[FAMILY][0],
                         "--mlx-path", tmp_path / "out")
    assert message.endswith(f"{EXPERTS_FILE}: No space left on device"), message
    assert list(tmp_path.iterdir()) == []


def test_a_permission_error_names_the_file(pack, monkeypatch):
    opened = reads_module.os.open

    def refuse(path, *args, **kwargs):
        if str(path).endswith(EXPERTS_FILE):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return opened(path, *args, **kwargs)

    monkeypatch.setattr(reads_module.os, "open", refuse)
    message = error_line(generate.main, "--model", pack)
    assert message == f"edgemoe.generate: error: {pack / EXPERTS_FILE}: Permission denied"


def test_a_bad_trace_is_one_line(tmp_path):
    (tmp_path / "t.npz").write_bytes(b"not a trace")
    assert "not a routing trace" in error_line(cache_sim.main, tmp_path / "t.npz")


def test_corruption_found_mid_decode_is_one_line_and_debug_shows_the_traceback(pack):
    layer = corrupt_record(pack, 0, 0)  # expert 0 of the first MoE layer: soon needed
    Pack.open(pack)  # the manifest is intact: only reading the record finds it
    args = ["--model", pack, "-m", "40", "--expert-budget", "1.0",
            "--prompt", "tell me a long story about the sea"]
    assert f"layer {layer.index} expert 0: checksum mismatch" in error_line(generate.main, *args)
    with pytest.raises(PackError, match="checksum mismatch"):  # --debug: the traceback
        generate.main(list(map(str, args + ["--debug"])))


def test_a_pack_that_cannot_fit_is_refused_before_writing(checkpoints, tmp_path, monkeypatch):
    real = convert.shutil.disk_usage
    monkeypatch.setattr(convert.shutil, "disk_usage",
                        lambda p: real(p)._replace(free=1000))  # a nearly full disk
    message = error_line(convert.main, "--hf-path", checkpoints[FAMILY][0],
                         "--mlx-path", tmp_path / "out")
    assert f"{tmp_path}: the pack needs " in message and "the disk has 0.00 GB free" in message
    assert list(tmp_path.iterdir()) == []


# ---- a pack cannot lie (issue 41) ------------------------------------------------------

def test_a_tampered_config_is_named_with_the_field_it_changed(pack):
    config = json.loads((pack / "config.json").read_text())
    config["num_experts_per_tok"] = 8
    (pack / "config.json").write_text(json.dumps(config))
    message = error_line(generate.main, "--model", pack, "-m", 1)
    assert f"{pack / 'config.json'}: checksum mismatch" in message
    assert "num_experts_per_tok (expected 2, found 8)" in message


def test_a_config_changed_in_a_pack_without_its_checksum_is_caught_by_its_routing(pack):
    edit_manifest(pack, lambda m: m.pop("config"))  # as packs written before issue 41
    Pack.open(pack)
    config = json.loads((pack / "config.json").read_text())
    for k in (8, 0):
        config["num_experts_per_tok"] = k
        (pack / "config.json").write_text(json.dumps(config))
        message = error_line(generate.main, "--model", pack, "-m", 1)
        # (0: no model routes to no expert: refused by the config's shape check)
        assert ("experts per token, the pack was written for 2 (manifest top_k" in message
                if k else "num_experts_per_tok is 0, expected 1 to" in message), message


def test_records_that_overlap_or_point_before_the_file_are_refused(pack):
    def same_bytes(m):  # expert 3 pointing at expert 2's record (with its checksum)
        m["layers"][0]["records"][3] = list(m["layers"][0]["records"][2])

    edit_manifest(pack, same_bytes)
    message = error_line(generate.main, "--model", pack, "-m", 1)
    assert "layer 0 expert 3: its record (offset" in message and "overlaps layer 0 expert 2" \
        in message
    edit_manifest(pack, lambda m: m["layers"][0]["records"][3].__setitem__(0, -16384))
    assert "record offset must be a non-negative integer, found -16384" in error_line(
        generate.main, "--model", pack, "-m", 1)


def test_a_shape_inflated_past_its_byte_count_is_refused_before_any_slot(pack):
    def inflate(m):
        t = m["layers"][0]["tensors"][0]
        t["shape"] = [t["shape"][0] * 100000] + t["shape"][1:]

    edit_manifest(pack, inflate)
    message = error_line(server.main, "--model", pack, "--expert-budget", "50%")
    assert "layer 0 tensor" in message and "the manifest says" in message


def _one_line(fn):
    """fn() passes, or fails with a PackError (a ValueError) of one line."""
    try:
        fn()
    except ValueError as e:
        assert "\n" not in str(e) and str(e), repr(e)


def test_fuzzed_manifests_and_headers_give_one_line_errors(pack):
    """Random damage to the manifest (types, signs, sizes, nesting) and to the resident
    file's header: every outcome is a pack that opens or one line; never a traceback."""
    import random

    rng = random.Random(41)
    original = (pack / MANIFEST).read_text()
    values = [None, -1, -16384, 2**64, 1.5, "x", [], {}, True, [[]], [-1, 10, 0],
              "9" * 400, [2**40, 16384, 0]]

    def mutate(node, depth=0):
        if isinstance(node, dict) and node:
            key = rng.choice(sorted(node))
            if rng.random() < 0.4 or depth > 6:
                if rng.random() < 0.2:
                    node.pop(key)
                else:
                    node[key] = rng.choice(values)
            else:
                mutate(node[key], depth + 1)
        elif isinstance(node, list) and node:
            i = rng.randrange(len(node))
            if rng.random() < 0.4 or not isinstance(node[i], (dict, list)):
                node[i] = rng.choice(values)
            else:
                mutate(node[i], depth + 1)

    for _ in range(300):
        m = json.loads(original)
        for _ in range(rng.randint(1, 3)):
            mutate(m)
        (pack / MANIFEST).write_text(json.dumps(m))
        _one_line(lambda: Pack.open(pack))
    for text in ("[" * 100000 + "]" * 100000, '{"format": ' + "[" * 100000, "\xff\xfe",
                 "[]", "null", '{"format": "edgemoe.pack", "version": 1, "layers": 3}'):
        (pack / MANIFEST).write_bytes(text.encode("latin-1"))
        _one_line(lambda: Pack.open(pack))
    (pack / MANIFEST).write_text(original)
    resident = pack / "model.safetensors"
    data = resident.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    bad_headers = [(2**40).to_bytes(8, "little") + data[8:],  # a 1 TB header length
                   (3).to_bytes(8, "little") + b"[[[" + data[11:],
                   (100000).to_bytes(8, "little") + b"[" * 100000 + data[8:]]
    name = next(k for k in header if k != "__metadata__")
    for change in ({"dtype": "F99"}, {"shape": [10**6, 10**6]}, {"data_offsets": [0, 10**12]},
                   {"data_offsets": "x"}, {"shape": "abc"}, {"dtype": ["F32"]}):
        h = json.loads(data[8:8 + length])
        h[name].update(change)
        raw = json.dumps(h).encode().ljust(length)
        if len(raw) == length:
            bad_headers.append(data[:8] + raw + data[8 + length:])
    for damaged in bad_headers:
        resident.write_bytes(damaged)
        with pytest.raises(ValueError) as e:
            Pack.open(pack)
        assert str(resident) in str(e.value) and "\n" not in str(e.value), e.value
    resident.write_bytes(data)
    Pack.open(pack)
    resident.write_bytes(bad_headers[0])
    assert str(resident) in error_line(generate.main, "--model", pack, "--no-verify", "-m", 1)


def test_a_pack_written_before_the_config_field_keeps_loading(pack):
    """As the first bundled model's pack was: its manifest records no config.json."""
    edit_manifest(pack, lambda m: m.pop("config"))
    assert Pack.open(pack).config is None


def test_a_config_nested_100k_deep_is_one_line(pack):
    (pack / "config.json").write_text("[" * 100000 + "]" * 100000)
    message = error_line(generate.main, "--model", pack, "-m", 1)
    assert f"{pack / 'config.json'}: not valid JSON (maximum recursion depth" in message
