"""The expert store: budgets, slots filled in place, LFU, and clear errors on bad input."""

import json
import os
import shutil
import threading

import numpy as np
import pytest

import edgemoe
from edgemoe.format.families import UnsupportedModelError
from edgemoe.format.pack import Pack, PackError
from edgemoe.streaming.budget import BudgetError, parse_budget
from edgemoe.streaming.calls import passes, run_call
from edgemoe.streaming.fills import FREE, READY
from edgemoe.mlx_backend.slots import MLXSlotMemory
from edgemoe.streaming.store import ExpertStore
from edgemoe.streaming.budget import minimum_bytes  # noqa: E402

from conftest import corrupt_record


def test_parse_budget():
    total = 1000
    assert parse_budget(0.25, total) == 250
    assert parse_budget(1.0, total) == 1000
    assert parse_budget(1, total) == 1000
    assert parse_budget("25%", total) == 250
    assert parse_budget("0.5", total) == 500
    assert parse_budget(4096, total) == 4096
    assert parse_budget("2GB", total) == 2 * 10**9
    assert parse_budget("1.5 MiB", total) == int(1.5 * 2**20)
    for bad in ("lots", "3 parsecs", -1, 0):
        with pytest.raises(BudgetError):
            parse_budget(bad, total)


def test_slots_are_filled_in_place_with_the_records_bytes(packs):
    pack = Pack.open(packs["qwen3_moe"]["hf"])
    store = ExpertStore(pack, 0.25, memory=MLXSlotMemory)
    layer = pack.layers[1]
    slots = store.layers[layer.module]
    table = slots.ensure(np.array([5, 11]))
    data = pack.experts_path.read_bytes()
    for expert in (5, 11):
        record = layer.records[expert]
        got = b"".join(np.array(slots.arrays[t.name][table[expert]]).tobytes()
                       for t in layer.tensors)
        assert got == data[record.offset:record.offset + record.length]


def test_lfu_evicts_the_least_used_and_never_a_pinned_expert(packs):
    pack = Pack.open(packs["qwen3_moe"]["hf"])
    store = ExpertStore(pack, minimum_bytes(pack) * 2, "lfu",  # 4 slots a layer
                        memory=MLXSlotMemory)
    slots = store.layers[pack.layers[0].module]
    assert slots.num_slots == 4
    for step in ([0, 1], [2, 3], [0, 4]):  # the last evicts 1: 0 is used more, and 1 is
        #                                     the least recent of those used as often
        slots.ensure(np.array(step))
        slots.release()
    assert slots.slot_of[1] == -1 and all(slots.slot_of[[0, 2, 3, 4]] >= 0)
    slots.ensure(np.array([5, 6, 7, 2]))
    assert all(slots.slot_of[[5, 6, 7, 2]] >= 0)
    assert store.stats.evictions == 4 and store.stats.hits == 2
    with pytest.raises(AssertionError):  # in use: nothing can be evicted for more
        slots.ensure(np.array([8, 9, 10, 11, 12]))


def test_a_read_that_cannot_start_leaves_no_slot_filling_and_the_hits_ready(packs, monkeypatch):
    pack = Pack.open(packs["qwen3_moe"]["hf"])
    store = ExpertStore(pack, minimum_bytes(pack) * 2, "lfu",  # 4 slots a layer
                        memory=MLXSlotMemory)
    slots = store.layers[pack.layers[0].module]
    slots.finish(slots.claim([0, 1, 2, 3]))
    slots.release()
    assert slots.ready == {0, 1, 2, 3}

    def broken(slot, expert):
        raise OSError("staging failed")

    monkeypatch.setattr(slots.memory, "stage", broken)
    with pytest.raises(OSError, match="staging failed"):
        slots.claim([0, 1, 5])  # two hits, then a miss whose fill cannot start
    # its hits are ready again; its victim (3: as used as 2, and touched first as its
    # read started, the last first) was given up, and its slot is free, not left filling
    assert slots.in_use == [] and slots.ready == {0, 1, 2} and not slots.fills
    assert slots.slot_of[5] == -1 and slots.slot_of[3] == -1
    assert sorted(slots.state.tolist()) == [FREE, READY, READY, READY]
    monkeypatch.undo()
    fills = slots.claim([0, 1, 6])  # the next call claims as ever
    slots.finish(fills)
    assert sorted(slots.in_use) == sorted(slots.slot_of[[0, 1, 6]].tolist())
    slots.release()


def test_budget_too_small_names_the_minimum(packs):
    pack = Pack.open(packs["olmoe"]["hf"])
    minimum = minimum_bytes(pack)
    with pytest.raises(BudgetError, match=f"minimum is .*{minimum} bytes"):
        edgemoe.load(pack.path, expert_budget=minimum - 1)
    ExpertStore(pack, minimum, memory=MLXSlotMemory)


def test_budget_counts_slot_memory(packs):
    pack = Pack.open(packs["qwen3_moe_large"]["hf"])
    store = ExpertStore(pack, 0.25, memory=MLXSlotMemory)
    assert store.info().slot_bytes <= 0.25 * pack.expert_bytes
    assert store.slots_per_layer == 8  # 32 experts


@pytest.fixture
def pack_copy(packs, tmp_path):
    dst = tmp_path / "pack"
    shutil.copytree(packs["mixtral"]["hf"], dst)
    return dst


def test_corrupt_record_names_layer_and_expert(pack_copy):
    layer = corrupt_record(pack_copy, layer=2, expert=3)
    store = ExpertStore(Pack.open(pack_copy), 1.0, memory=MLXSlotMemory)
    with pytest.raises(PackError, match=r"experts.bin: layer 2 expert 3: checksum mismatch "
                                        r"\(expected [0-9a-f]{8}, found [0-9a-f]{8}\)"):
        store.layers[layer.module].ensure(np.array([3]))
    store.layers[layer.module].ensure(np.array([4]))  # the others still load


def test_truncated_experts_file(pack_copy):
    path = pack_copy / "experts.bin"
    size = path.stat().st_size
    os.truncate(path, size - 5000)
    with pytest.raises(PackError, match=f"truncated .*expected {size} bytes, found {size - 5000}"):
        edgemoe.load(pack_copy)


def test_manifest_version_mismatch(pack_copy):
    manifest = json.loads((pack_copy / "manifest.json").read_text())
    manifest["version"] = 99
    (pack_copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PackError, match="format version 99, this edgemoe reads version 1"):
        edgemoe.load(pack_copy)


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such model folder"):
        edgemoe.load(tmp_path / "absent")


def test_unquantized_checkpoint_needs_converting(checkpoints):
    with pytest.raises(PackError, match="neither an edgemoe pack.*edgemoe.convert"):
        edgemoe.load(checkpoints["mixtral"][0])


def test_a_checkpoint_in_place_is_opened_at_the_experts_mlx_lm_finds(checkpoints):
    """format/ reads no model class: an mlx-lm checkpoint is opened in place at the routed
    experts it is handed (mlx-lm's, by edgemoe.mlx_backend.families), or refused in one
    line saying so."""
    from edgemoe.format.source import open_source
    from edgemoe.mlx_backend.families import find_experts, routed_experts
    from mlx_lm import load as mlx_lm_load

    path = checkpoints["qwen3_moe"][1]
    with pytest.raises(PackError, match="needs its routed experts found") as e:
        open_source(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    source = open_source(path, find_experts=find_experts)
    paths, k = routed_experts(mlx_lm_load(str(path))[0], path)  # mlx-lm's model, loaded
    assert source.in_place and [l.module for l in source.layers] == paths
    assert source.top_k == k


def test_unsupported_model_type(pack_copy):
    manifest = json.loads((pack_copy / "manifest.json").read_text())
    manifest.pop("config")  # a pack written before config.json's checksum (which names it)
    (pack_copy / "manifest.json").write_text(json.dumps(manifest))
    config = json.loads((pack_copy / "config.json").read_text())
    config["model_type"] = "llama"
    (pack_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="'llama' has no routed experts"):
        edgemoe.load(pack_copy)


class GatedReader:
    """The store's reader, holding back each submitted run until `gate` is set."""

    def __init__(self, reader, gate):
        self.reader, self.gate = reader, gate

    def submit(self, fills):
        def later():
            self.gate.wait()
            self.reader.submit(fills)

        threading.Thread(target=later, daemon=True).start()

    def __getattr__(self, name):
        return getattr(self.reader, name)


def test_counters_by_value_at_the_minimum_budget(packs):
    """Known requests at 2 slots a layer under LFU: every counter, and the hit rate."""
    pack = Pack.open(packs["qwen3_moe"]["hf"])
    store = ExpertStore(pack, minimum_bytes(pack), "lfu", memory=MLXSlotMemory)
    layer = pack.layers[1]
    pool, size = store.pool(layer.index), layer.expert_bytes
    pool.ensure(np.array([0, 1]))  # 2 on demand
    pool.release()
    pool.ensure(np.array([1, 2]))  # 1 hit; 2 evicts 0
    pool.release()
    pool.prefetch(np.array([3]))  # evicts 2 (used less than 1), read ahead
    pool._wait(list(pool.fills.values()))
    pool.ensure(np.array([1, 3]))  # 2 hits: 3 was prefetched
    pool.release()
    gate = threading.Event()
    pool.reader = GatedReader(store.reader, gate)
    pool.prefetch(np.array([4]))  # still being read when it is needed: late
    threading.Timer(0.05, gate.set).start()
    pool.ensure(np.array([4]))
    pool.release()
    s = store.snapshot()
    assert (s.hits, s.late_fills, s.on_demand, s.prefetches, s.loads, s.evictions) == \
        (3, 1, 3, 2, 5, 3)
    assert s.requests == 7 and s.hit_rate == 3 / 7
    assert s.bytes_read == 5 * size and s.bytes_used == 7 * size and s.bytes_hit == 3 * size
    assert s.blocked_s > 0  # waited for the late fill at least
    assert (s.predicted, s.predicted_used, s.needed) == (2, 2, 3)  # both predictions used
    store.close()


def test_a_batchs_prediction_reads_each_expert_once(packs):
    """A prediction for several rows names some experts twice: each is read once."""
    pack = Pack.open(packs["qwen3_moe"]["hf"])
    store = ExpertStore(pack, 2 * minimum_bytes(pack), "lfu",  # 4 slots a layer
                        memory=MLXSlotMemory)
    layer = pack.layers[1]
    store.prefetch(layer.index, np.array([[3, 1], [1, 3], [2, 3]], dtype=np.uint32), 1)
    pool = store.pool(layer.index)
    pool._wait(list(pool.fills.values()))
    assert store.snapshot().prefetches == 3 and sorted(pool.prefetched) == [1, 2, 3]
    assert pool.next_prediction == {1, 2, 3}


def test_a_pass_reads_the_next_one_ahead_into_the_free_half(packs):
    """A call with more experts than slots runs in passes of half the pool; the next pass
    is read into the other half while one computes, and counted as loaded on demand."""
    pack = Pack.open(packs["qwen3_moe"]["hf"])
    store = ExpertStore(pack, 2 * minimum_bytes(pack), "lfu",  # 4 slots a layer
                        memory=MLXSlotMemory)
    pool = store.pool(pack.layers[1].index)
    assert [g.tolist() for g in passes(np.arange(6), pool.num_slots)] == [[0, 1], [2, 3], [4, 5]]
    slot_of = pool.ensure(np.array([0, 1]))
    in_use = set(slot_of[[0, 1]].tolist())
    pool.read_ahead(np.array([2, 3]))
    assert set(pool.slot_of[[2, 3]].tolist()).isdisjoint(in_use)  # never a slot in use
    pool._wait(list(pool.fills.values()))
    pool.release()
    pool.ensure(np.array([2, 3]), new_call=False)
    pool.release()
    s = store.snapshot()
    assert (s.hits, s.on_demand, s.loads, s.evictions) == (0, 4, 4, 0)
    store.close()


def test_a_call_over_the_pool_computes_what_is_in_slots_first(packs):
    """A call with more experts than slots (a verify window, a prefill): the experts
    already in slots make the first pass, so no earlier pass evicts them to read them
    again (in id order, the passes before them would)."""
    pack = Pack.open(packs["qwen3_moe"]["hf"])
    store = ExpertStore(pack, 2 * minimum_bytes(pack), "lfu",  # 4 slots a layer
                        memory=MLXSlotMemory)
    pool = store.pool(pack.layers[1].index)
    pool.ensure(np.array([4, 5]))
    pool.release()
    before = store.snapshot()
    run_call(pool, np.arange(6).reshape(3, 2), lambda rows, slot_ids: None)
    s = store.snapshot() - before
    assert (s.hits, s.loads) == (2, 4)  # 4 and 5 computed from their slots, 0-3 read once
    store.close()


def test_a_flipped_resident_byte_fails_at_load(pack_copy):
    from edgemoe.format.inplace import safetensors_header

    header, start = safetensors_header(pack_copy / "model.safetensors")
    begin, _ = header["lm_head.scales"]["data_offsets"]
    with open(pack_copy / "model.safetensors", "r+b") as f:
        f.seek(start + begin + 1)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))  # an exponent bit of one scale
    with pytest.raises(PackError, match=r"model.safetensors: tensor lm_head.scales: checksum "
                                        r"mismatch \(expected [0-9a-f]{8}, found [0-9a-f]{8}\)"):
        edgemoe.load(pack_copy)
    edgemoe.load(pack_copy, verify=False)  # --no-verify: the user's choice


@pytest.mark.parametrize("what", ["record", "resident"])
def test_a_missing_checksum_is_an_error_not_a_silent_skip(pack_copy, what):
    manifest = json.loads((pack_copy / "manifest.json").read_text())
    if what == "record":
        manifest["layers"][1]["records"][3][2] = None
        expected = r"layer \d+ expert 3 has no checksum.*--no-verify"
    else:
        manifest["resident"]["crc32"] = None
        expected = r"no checksums for model.safetensors.*--no-verify"
    (pack_copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PackError, match=expected):
        edgemoe.load(pack_copy)
    model, _ = edgemoe.load(pack_copy, verify=False)
    assert model.expert_store.info().moe_layers == 4


def test_the_generate_cli_says_no_verify_in_one_line(pack_copy):
    import subprocess
    import sys

    manifest = json.loads((pack_copy / "manifest.json").read_text())
    manifest["resident"]["crc32"] = None
    (pack_copy / "manifest.json").write_text(json.dumps(manifest))
    r = subprocess.run([sys.executable, "-m", "edgemoe.generate", "--model", str(pack_copy),
                        "--max-tokens", "2"], capture_output=True, text=True)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "--no-verify" in r.stderr
    r = subprocess.run([sys.executable, "-m", "edgemoe.generate", "--model", str(pack_copy),
                        "--max-tokens", "2", "--no-verify"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
