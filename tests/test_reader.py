"""The background reader under stress and under faults."""

import errno
import os
import shutil
import threading
import time

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load as mlx_lm_load

import edgemoe
from edgemoe.format.pack import Pack, PackError
from edgemoe.streaming.budget import minimum_bytes
from edgemoe.mlx_backend.slots import MLXSlotMemory
from edgemoe.streaming.store import ExpertStore


def streaming_modules(model):
    modules = dict(model.named_modules())
    return {path: modules[path] for path in model.expert_store.layers}


def test_random_routing_at_a_tight_budget_never_reads_a_stale_slot(packs, checkpoints):
    """Hundreds of steps of random routing, with random prefetches racing the compute:
    every expert computed on holds the file's bytes, and every output equals mlx-lm's
    own expert module over all experts."""
    path = packs["qwen3_moe"]["hf"]
    pack = Pack.open(path)
    model, _ = edgemoe.load(path, expert_budget=minimum_bytes(pack) * 3 // 2)
    store = model.expert_store
    assert store.slots_per_layer == 3
    reference, _ = mlx_lm_load(str(checkpoints["qwen3_moe"][1]))
    ref_modules = dict(reference.named_modules())
    data = pack.experts_path.read_bytes()
    rng = np.random.default_rng(0)
    layers = list(store.layers.values())
    for step in range(150):
        for path, module in streaming_modules(model).items():
            slots = store.layers[path]
            ids = rng.choice(16, size=2, replace=False)
            x = mx.array(rng.standard_normal((1, 1, 64)).astype(np.float32))
            layers[rng.integers(len(layers))].prefetch(rng.choice(16, size=2, replace=False))
            out = module(x, mx.array(ids[None, None].astype(np.uint32)))
            expected = ref_modules[path](x, mx.array(ids[None, None].astype(np.uint32)))
            assert mx.array_equal(out, expected).item(), (step, path)
            for e in ids:
                record, slot = slots.layer.records[e], slots.slot_of[e]
                held = b"".join(np.array(slots.arrays[t.name][slot]).tobytes()
                                for t in slots.layer.tensors)
                assert held == data[record.offset:record.offset + record.length]
    stats = store.snapshot()
    # late fills are pinned by value in test_store's counters test; here they may or not occur
    assert stats.evictions > 500 and stats.prefetches > 100


@pytest.fixture
def own_pack(packs, tmp_path):
    dst = tmp_path / "pack"
    shutil.copytree(packs["olmoe"]["hf"], dst)
    return dst


def generate_until_error(model, tokenizer, seconds=20):
    """Generate until an error; return (the error, seconds from its last good token)."""
    last = time.perf_counter()
    deadline = last + seconds
    while time.perf_counter() < deadline:
        try:
            for _ in edgemoe.stream_generate(model, tokenizer, "tell me more", max_tokens=8):
                last = time.perf_counter()
        except PackError as e:
            return e, time.perf_counter() - last
    pytest.fail("no error surfaced")


def test_read_error_mid_run_is_a_clear_error_and_the_store_recovers(own_pack, monkeypatch):
    model, tokenizer = edgemoe.load(own_pack, expert_budget=0.25, routing="advisory")
    edgemoe.generate(model, tokenizer, "hello", max_tokens=4)
    real_preadv = os.preadv

    def failing_preadv(fd, buffers, offset):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "preadv", failing_preadv)
    error, delay = generate_until_error(model, tokenizer)
    assert "read failed (Input/output error)" in str(error) and "layer" in str(error)
    assert delay < 1.0
    monkeypatch.setattr(os, "preadv", real_preadv)
    edgemoe.generate(model, tokenizer, "hello again", max_tokens=4)  # the same store works
    fresh, tokenizer = edgemoe.load(own_pack, expert_budget=0.25)
    edgemoe.generate(fresh, tokenizer, "hello", max_tokens=4)


def test_file_truncated_under_the_reader(own_pack):
    experts = own_pack / "experts.bin"
    saved = experts.read_bytes()
    model, tokenizer = edgemoe.load(own_pack, expert_budget=minimum_bytes(
        Pack.open(own_pack)))
    edgemoe.generate(model, tokenizer, "hello", max_tokens=4)
    os.truncate(experts, len(saved) // 3)
    error, delay = generate_until_error(model, tokenizer)
    assert "truncated" in str(error) and delay < 1.0
    experts.write_bytes(saved)
    fresh, tokenizer = edgemoe.load(own_pack, expert_budget=0.25)
    edgemoe.generate(fresh, tokenizer, "hello", max_tokens=4)


def test_advisory_telemetry(packs):
    model, tokenizer = edgemoe.load(packs["deepseek_v3"]["hf"], expert_budget=0.5,
                                    routing="advisory")
    responses = list(edgemoe.stream_generate(model, tokenizer, "hello world", max_tokens=16))
    stats = model.expert_store.snapshot()
    assert stats.prefetches > 0 and stats.needed > 0
    assert 0 < stats.precision <= 1 and 0 < stats.recall <= 1
    assert stats.read_busy_s > 0 and stats.read_gbps > 0
    assert responses[-1].decode_experts is not None


def test_direct_io_reads_bypass_the_page_cache(own_pack):
    from edgemoe.streaming.telemetry import page_cache_bytes

    files = [own_pack / "experts.bin", own_pack / "model.safetensors"]
    for f in files:
        drop_from_page_cache(f)
    assert sum(map(page_cache_bytes, files)) == 0
    model, tokenizer = edgemoe.load(own_pack, expert_budget=0.25, io="direct")
    assert model.expert_store.reader.io == "direct"
    edgemoe.generate(model, tokenizer, "hello", max_tokens=8)
    assert model.expert_store.snapshot().bytes_read > 0
    # the experts never came through the cache; the resident weights left it once loaded
    assert sum(map(page_cache_bytes, files)) == 0


def drop_from_page_cache(path):
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)  # dirty pages of a fresh copy cannot be dropped
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def test_direct_io_in_place_leaves_the_page_cache_empty(checkpoints, tmp_path):
    """An mlx-lm checkpoint read in place with O_DIRECT: each tensor slice read as its
    aligned span, the shards' pages (the resident weights' too, once loaded) dropped;
    the tokens are those of buffered reads."""
    from edgemoe.streaming.telemetry import page_cache_bytes

    src = shutil.copytree(checkpoints["qwen3_moe"][1], tmp_path / "mlx")
    shards = sorted(src.glob("model*.safetensors"))
    buffered, tokenizer = edgemoe.load(src, expert_budget=0.25)
    expected = edgemoe.generate(buffered, tokenizer, "hello", max_tokens=8)
    for f in shards:
        drop_from_page_cache(f)
    model, tokenizer = edgemoe.load(src, expert_budget=0.25, io="direct")
    assert model.expert_store.reader.io == "direct"
    assert edgemoe.generate(model, tokenizer, "hello", max_tokens=8) == expected
    assert model.expert_store.snapshot().bytes_read > 0
    assert sum(page_cache_bytes(f) for f in shards) == 0


def test_adjacent_records_are_merged_into_one_read_of_bounded_length(packs, monkeypatch):
    from edgemoe.streaming import reader as reader_module
    from edgemoe.streaming.reader import Reader
    from edgemoe.streaming.reads import Fill

    pack = Pack.open(packs["qwen3_moe"]["hf"])
    reader = Reader(pack, threads=1)
    reader.close()  # inspect the queue without threads taking from it
    layer = pack.layers[0]

    def runs_of(experts):
        reader.submit([Fill(0, e, 0, layer.records[e], [], lambda *a: None) for e in experts])
        runs = []
        while not reader.queue.empty():
            run = reader.queue.get()
            if run is not None:
                runs.append([f.expert for f in run])
        return runs

    assert runs_of((7, 3, 4, 5, 9)) == [[3, 4, 5], [7], [9]]
    two = layer.records[4].offset + layer.records[4].length - layer.records[3].offset
    monkeypatch.setattr(reader_module, "MAX_RUN_BYTES", two)  # a read spans two at most
    assert runs_of((7, 3, 4, 5, 9)) == [[3, 4], [5], [7], [9]]


def test_a_reader_closed_on_its_own_thread_closes_and_its_threads_end(packs):
    """A store dropped by the last reference a fill's end held is closed on its reader's
    own thread (`ExpertStore.__del__`): the close completes there, its files closed and
    every thread ended, not stopped by a thread joining itself."""
    from edgemoe.streaming.reader import Reader
    from edgemoe.streaming.reads import Fill

    pack = Pack.open(packs["qwen3_moe"]["hf"])
    reader = Reader(pack, threads=2)
    record = pack.layers[0].records[3]
    errors, done = [], threading.Event()

    def close_here(fill, nbytes, error):
        try:
            reader.close()
        except Exception as e:  # (what __del__ would have swallowed)
            errors.append(e)
        done.set()

    reader.submit([Fill(0, 3, 0, record, [np.empty(record.length, np.uint8)], close_here)])
    assert done.wait(10) and errors == []
    for t in reader.threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in reader.threads) and reader.fds == []


def test_a_merged_read_never_passes_preadvs_buffer_limit(packs):
    """preadv takes at most IOV_MAX buffers (else EINVAL): a layer of 128 fine-grained
    experts, 9 tensors each plus a gap, would pass it merged into one read."""
    from edgemoe.streaming.reader import MAX_RUN_BUFFERS, Reader
    from edgemoe.streaming.reads import Fill

    pack = Pack.open(packs["qwen3_moe"]["hf"])
    reader = Reader(pack, threads=1)
    reader.close()
    layer = pack.layers[0]
    many = [None] * (MAX_RUN_BUFFERS // 3)  # three such records pass the limit together
    reader.submit([Fill(0, e, 0, layer.records[e], many, lambda *a: None) for e in (3, 4, 5)])
    runs = []
    while not reader.queue.empty():
        run = reader.queue.get()
        if run is not None:  # close()'s stop marks
            runs.append([f.expert for f in run])
    assert runs == [[3, 4], [5]]


def test_in_place_slices_are_read_concurrently_and_a_failed_slice_fails_its_fill_once(
        checkpoints, monkeypatch):
    """An expert read in place is one queued read per tensor slice, finished by the last
    to land; one slice failing fails its expert alone, once, with a clear error."""
    from edgemoe.format.inplace import open_mlx_lm
    from edgemoe.mlx_backend.families import find_experts
    from edgemoe.streaming.reader import Reader
    from edgemoe.streaming.reads import Fill, Slice

    pack = open_mlx_lm(checkpoints["qwen3_moe"][1], find_experts)
    layer = pack.layers[0]
    closed = Reader(pack, threads=1)
    closed.close()  # inspect the queue without threads taking from it
    closed.submit([Fill(0, e, 0, layer.records[e], [], lambda *a: None) for e in (2, 5)])
    queued = [closed.queue.get() for _ in range(closed.queue.qsize())]
    slices = [(q.fill.expert, q.index) for q in queued if isinstance(q, Slice)]
    n = len(layer.records[2].segments)
    assert n > 1 and slices == [(e, i) for e in (2, 5) for i in range(n)]

    bad_offset = layer.records[5].segments[n - 1][1]
    real_preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, offset: (
        _raise(OSError(errno.EIO, "EIO")) if offset == bad_offset else
        real_preadv(fd, bufs, offset)))
    results = []
    reader = Reader(pack, threads=4)
    fills = [Fill(0, e, 0, layer.records[e],
                  [np.empty(length, np.uint8) for _, _, length in layer.records[e].segments],
                  lambda f, nbytes, err: (results.append((f.expert, err)), f.done.set()))
             for e in (2, 5, 7)]
    reader.submit(fills)
    for f in fills:
        assert f.done.wait(10)
    reader.close()
    assert sorted(e for e, _ in results) == [2, 5, 7]  # each finished exactly once
    errors = dict(results)
    assert errors[2] is None and errors[7] is None
    assert "layer 0 expert 5: read failed" in str(errors[5])
    for f in (fills[0], fills[2]):
        for (i, offset, length), buf in zip(f.record.segments, f.buffers):
            with open(pack.files[i], "rb") as file:
                file.seek(offset)
                assert buf.tobytes() == file.read(length)


def _raise(e):
    raise e


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_read_time_counts_the_reads_alone(packs, monkeypatch):
    """With a clock that moves 1 s per preadv and 100 s per CRC32 pass, the store's read
    time is exactly the reads' and its verify time exactly the checks'."""
    import zlib

    from edgemoe.streaming import reads as reads_module

    pack = Pack.open(packs["qwen3_moe"]["hf"])
    store = ExpertStore(pack, 1.0, readers=1, memory=MLXSlotMemory)
    clock, counts = FakeClock(), {"read": 0, "crc": 0}
    store.reader.clock = clock
    preadv, crc32 = os.preadv, zlib.crc32

    def timed_preadv(*args):
        counts["read"] += 1
        clock.t += 1.0
        return preadv(*args)

    def timed_crc32(*args):
        counts["crc"] += 1
        clock.t += 100.0
        return crc32(*args)

    monkeypatch.setattr(reads_module.os, "preadv", timed_preadv)
    monkeypatch.setattr(reads_module.zlib, "crc32", timed_crc32)
    pool = store.pool(pack.layers[0].index)
    pool.ensure(np.array([0, 5, 9]))  # records apart in the file: separate reads
    pool.release()
    s = store.snapshot()
    assert counts["read"] == 3 and s.read_busy_s == 3.0
    assert counts["crc"] > 0 and s.verify_s == 100.0 * counts["crc"]
    assert s.read_gbps == s.bytes_read / 3.0 / 1e9
    store.close()


def test_an_open_read_interval_is_split_at_a_snapshot(packs):
    pack = Pack.open(packs["qwen3_moe"]["hf"])
    store = ExpertStore(pack, 1.0, readers=1, memory=MLXSlotMemory)
    reader, clock = store.reader, FakeClock()
    reader.clock = clock
    with reader.lock:  # a read in flight since t = 1
        reader.busy, reader.busy_since = 1, 1.0
    clock.t = 4.0
    assert reader.busy_s == 3.0  # counted up to the snapshot, and no further
    clock.t = 6.0
    assert reader.busy_s == 5.0
    with reader.lock:
        reader.busy = 0
    store.close()
