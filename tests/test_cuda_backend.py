"""The CUDA backend's CPU-side logic, without a GPU: the slot state machine over device
slot memory, the ordering of copies and compute (on a fake device that records and
checks every operation), the int4 math against MLX's, and whole decodes on the CPU
against the MLX path.

Tolerance: fp32 logits on the CPU differ from the MLX path's by at most 1.4e-5 on the
coarse reference model bundled before the fine one (logits up to about 16), from summation
order alone; the tests
allow 1e-3 and require the same greedy tokens.
"""

import ast
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the CUDA backend needs PyTorch (edgemoe[cuda])")
pytest.importorskip("transformers", reason="the CUDA backend needs transformers")

import mlx.core as mx  # noqa: E402

import edgemoe  # noqa: E402
from edgemoe.whatif import experimental  # noqa: E402,F401  (registers "learned")
from edgemoe.streaming.cache import POLICIES  # noqa: E402
from edgemoe.cuda import int4  # noqa: E402
from edgemoe.cuda.model import DEFAULT_MODEL, greedy, load  # noqa: E402
from edgemoe.cuda.host import HostTier  # noqa: E402
from edgemoe.cuda.slots import DeviceSlotMemory  # noqa: E402
from edgemoe.cuda.streams import HostStreams  # noqa: E402
from edgemoe.format.pack import Pack, PackError  # noqa: E402
from edgemoe.mlx_backend.slots import MLXSlotMemory  # noqa: E402
from edgemoe.streaming.fills import FILLING, FREE, READY  # noqa: E402
from edgemoe.streaming.store import ExpertStore  # noqa: E402
from edgemoe.streaming.budget import minimum_bytes  # noqa: E402

import gpu_check  # noqa: E402  (scripts/, on the path through conftest)
from conftest import corrupt_record  # noqa: E402

LOGIT_TOLERANCE = 1e-3


class FakeEvent:
    def __init__(self, name):
        self.name, self.done = name, False

    def __repr__(self):
        return self.name


class FakeDevice:
    """A GPU as the slot memory sees it, run on the host.

    Each copy stream (`lanes`) is a queue of (wait, copy, record) operations executed in
    order as soon as the compute events they wait on are done; a copy reads its source
    when it executes, as a DMA does. Compute events stay pending until `finish_compute`
    (the GPU caught up), or until compute waits on an event: the compute stream is in
    order, so everything issued before that wait has run. A host that waits on an event
    lets the GPU run on (`gpu_runs=True`, as a real one does), or blocks until a test
    calls `finish_compute` (`gpu_runs=False`, to look at what waits). `log` records every
    call, with the lane of copy operations.
    """

    pinned = False

    def __init__(self, lanes=1, gpu_runs=True):
        self.lanes, self.gpu_runs = lanes, gpu_runs
        self.log, self.queues = [], [[] for _ in range(lanes)]
        self.cond = threading.Condition(threading.RLock())
        self.count = 0
        self.pending_compute = []

    def _event(self, kind):
        self.count += 1
        return FakeEvent(f"{kind}#{self.count}")

    def copy(self, dst, src, lane=0):
        with self.cond:
            self.log.append(("copy", dst.data_ptr()))
            self.queues[lane].append(("copy", dst, src))
            self._pump()

    def record_copy(self, lane=0):
        with self.cond:
            event = self._event("copy")
            self.log.append(("record_copy", event))
            self.queues[lane].append(("record", event))
            self._pump()
            return event

    def copy_wait(self, event, lane=0):
        with self.cond:
            self.log.append(("copy_wait", event))
            self.queues[lane].append(("wait", event))
            self._pump()

    def record_compute(self):
        with self.cond:
            event = self._event("compute")
            self.log.append(("record_compute", event))
            self.pending_compute.append(event)
            return event

    def compute_wait(self, event):
        with self.cond:
            self.log.append(("compute_wait", event))
            self.finish_compute()
            assert event.done, f"compute would wait forever on {event}"

    def host_wait(self, event):
        with self.cond:
            self.log.append(("host_wait", event))
            if self.gpu_runs and not event.done:
                self.finish_compute()
            while not event.done:
                self.cond.wait(0.01)

    def finish_compute(self):
        with self.cond:
            for event in self.pending_compute:
                event.done = True
            self.pending_compute = []
            self._pump()

    def _pump(self):
        for queue in self.queues:
            while queue:
                op = queue[0]
                if op[0] == "wait" and not op[1].done:
                    break
                queue.pop(0)
                if op[0] == "copy":
                    op[1].copy_(op[2])
                    self.log.append(("executed_copy", op[1].data_ptr()))
                elif op[0] == "record":
                    op[1].done = True
        self.cond.notify_all()


def device_store(pack, budget, device=None, policy="lfu", host_rows=None):
    """A store of device slot memory on `device`, each layer's host tier `host_rows` rows
    (default: as many as slots)."""
    device = device or HostStreams()

    def memory(layer, n):
        host = HostTier(layer, host_rows or n, device)
        return DeviceSlotMemory(layer, n, "cpu", device, host)

    return ExpertStore(pack, budget, policy, memory=memory)


def record_bytes(pack, layer, expert):
    record = layer.records[expert]
    with open(pack.experts_path, "rb") as f:
        f.seek(record.offset)
        return f.read(record.length)


def device_bytes(slots, expert):
    return slots.memory.device_rows[slots.slot_of[expert]].numpy().tobytes()


def host_bytes(slots, row):
    return slots.memory.host.buffer[row].numpy().tobytes()


def hold_reads(slots) -> threading.Event:
    """The reader stops before it writes a row of `slots` until the event is set."""
    gate = threading.Event()
    before_read = slots.memory.before_read
    slots.memory.before_read = lambda slot: (gate.wait(5), before_read(slot))
    return gate


def wait_for(condition, timeout=5.0):
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


@pytest.fixture
def small(packs):
    """The tiny qwen3_moe pack, 2 slots a layer (its top-k)."""
    pack = Pack.open(packs["qwen3_moe"]["hf"])
    return pack, minimum_bytes(pack)


# --- the slot state machine and cache policies over device slot memory --------------

def test_slots_hold_the_records_bytes_and_tensor_views(small):
    pack, budget = small
    store = device_store(pack, budget * 2)
    layer = pack.layers[1]
    slots = store.layers[layer.module]
    table = slots.ensure(np.array([5, 11]))
    for expert in (5, 11):
        assert device_bytes(slots, expert) == record_bytes(pack, layer, expert)
        for t in layer.tensors:  # the per-tensor views compute reads
            view = slots.arrays[t.name][table[expert]]
            assert tuple(view.shape) == t.shape
            raw = record_bytes(pack, layer, expert)[t.offset:t.offset + t.nbytes]
            assert view.contiguous().numpy().tobytes() == raw
    store.close()


def lfu_reference(calls, slots):
    """(hits, loads, evictions) of an LFU pool of `slots` (ties: the least recent), written
    out independently: each call touches its experts in order, then loads its misses last
    first (each a touch)."""
    order, uses, hits, loads, evictions = [], {}, 0, 0, 0

    def touch(e):
        if e in order:
            order.remove(e)
        order.append(e)
        uses[e] = uses.get(e, 0) + 1

    for experts in calls:
        wanted = sorted(int(e) for e in experts)
        missing = [e for e in wanted if e not in order]
        hits += len(wanted) - len(missing)
        for e in wanted:
            touch(e)
        for e in reversed(missing):
            if len(order) > slots:  # evict the least used expert this call does not need
                victim = min((v for v in order if v not in wanted), key=uses.__getitem__)
                order.remove(victim)
                evictions += 1
            loads += 1
            touch(e)
    return hits, loads, evictions


@pytest.mark.parametrize("policy", sorted(set(POLICIES) - {"learned"}) + ["learned"])
def test_same_evictions_as_the_mlx_backend(small, policy):
    """The device slot memory leaves the state machine's decisions alone: the same slot
    tables, hits, loads and evictions as over MLX memory; under LFU both also match a
    reference LFU written out here."""
    pack, budget = small
    rng = np.random.default_rng(3)
    calls = [rng.choice(16, size=2, replace=False) for _ in range(40)]
    results = []
    for store in (ExpertStore(pack, budget * 3 // 2, policy, memory=MLXSlotMemory),
                  device_store(pack, budget * 3 // 2, policy=policy)):
        slots = store.layers[pack.layers[2].module]
        tables = []
        for experts in calls:
            tables.append(slots.ensure(np.sort(experts)).copy())
            slots.release()
        s = store.stats
        results.append((tables, s.hits, s.loads, s.evictions))
        store.close()
    mlx_result, device_result = results
    assert device_result[3] > 10, "the routing must evict"
    assert all(np.array_equal(a, b) for a, b in zip(mlx_result[0], device_result[0]))
    assert mlx_result[1:] == device_result[1:]
    if policy == "lfu":
        assert device_result[1:] == lfu_reference(calls, 3)


def test_the_store_never_evicts_an_expert_in_use(small):
    pack, budget = small
    store = device_store(pack, budget * 2)  # 4 slots
    slots = store.layers[pack.layers[0].module]
    for step in ([0, 1], [2, 3], [0, 4]):
        slots.ensure(np.array(step))
        slots.release()
    assert slots.slot_of[1] == -1 and all(slots.slot_of[[0, 2, 3, 4]] >= 0)
    slots.ensure(np.array([5, 6, 7, 2]))
    with pytest.raises(AssertionError):
        slots.ensure(np.array([8, 9, 10, 11, 12]))
    store.close()


# --- ordering of copies and compute on the fake device ------------------------------

def test_compute_waits_for_the_copy_and_a_refill_for_the_compute(small):
    """Rule 1: compute waits on a slot's copy event. Rule 2: a slot whose last compute
    has not finished is refilled only after it: its copy waits on the copy stream."""
    pack, budget = small
    device = FakeDevice()
    store = device_store(pack, budget, device)  # 2 slots: every new pair evicts
    layer = pack.layers[0]
    slots = store.layers[layer.module]
    slots.ensure(np.array([0, 1]))
    first_copies = [e for op, e in device.log if op == "record_copy"]
    waited = [e for op, e in device.log if op == "compute_wait"]
    assert sorted(map(str, waited)) == sorted(map(str, first_copies))
    slots.release()
    compute = device.log[-1][1]
    assert device.log[-1][0] == "record_compute" and not compute.done

    slots.prefetch(np.array([2, 3]))  # evicts 0 and 1 while their compute is pending
    wait_for(lambda: (slots.state == READY).sum() == 2 and not slots.fills)
    for expert in (2, 3):  # the copies are queued behind the compute: not done yet
        assert device_bytes(slots, expert) != record_bytes(pack, layer, expert)
    log = device.log[device.log.index(("record_compute", compute)):]
    assert [op for op, _ in log].count("copy_wait") == 2
    assert all(e is compute for op, e in log if op == "copy_wait")
    assert "executed_copy" not in [op for op, _ in log]

    device.finish_compute()  # the GPU catches up: the copies run
    for expert in (2, 3):
        assert device_bytes(slots, expert) == record_bytes(pack, layer, expert)
    mark = len(device.log)
    slots.ensure(np.array([2, 3]))
    assert [op for op, _ in device.log[mark:]] == ["compute_wait", "compute_wait"]
    slots.release()
    mark = len(device.log)
    slots.ensure(np.array([2, 3]))  # already waited on: the stream is in order
    assert [op for op, _ in device.log[mark:]] == []
    store.close()


def test_reader_does_not_overwrite_a_host_row_before_its_copy_ran(small):
    """The host tier's rule B: a row whose copy is still queued (behind compute) is not
    read into again until the copy has read it; the reader waits on its own thread."""
    pack, budget = small
    device = FakeDevice(gpu_runs=False)
    store = device_store(pack, budget, device)  # 2 slots, 2 host rows
    layer = pack.layers[3]
    slots = store.layers[layer.module]
    tier = slots.memory.host
    slots.ensure(np.array([0, 1]))
    slots.release()  # compute pending
    slots.prefetch(np.array([2, 3]))  # copies queued behind the compute
    wait_for(lambda: (slots.state == READY).sum() == 2 and not slots.fills)
    held = {tier.row_of[e]: host_bytes(slots, tier.row_of[e]) for e in (2, 3)}
    mark = len(device.log)
    slots.prefetch(np.array([4, 5]))  # evicts 2 and 3 (and their rows) before their copies ran
    # the reader thread stops at rule B, before it writes a row
    wait_for(lambda: any(op == "host_wait" for op, _ in device.log[mark:]))
    assert all(host_bytes(slots, r) == data for r, data in held.items()), "row overwritten"
    assert (slots.state == FILLING).sum() == 2
    device.finish_compute()
    wait_for(lambda: (slots.state == READY).sum() == 2 and not slots.fills)
    slots.ensure(np.array([4, 5]))
    for expert in (4, 5):
        assert device_bytes(slots, expert) == record_bytes(pack, layer, expert)
    executed = [ptr for op, ptr in device.log if op == "executed_copy"]
    assert len(executed) == 6  # 0, 1, then 2, 3 (run before their rows were reused), 4, 5
    store.close()


def test_a_record_is_copied_only_once_its_read_completed(small):
    """The host tier's rule A: the copy of a record read from disk is issued only after
    the read (and its checksum) finished; until then the slot's device row is untouched."""
    pack, budget = small
    device = FakeDevice()
    store = device_store(pack, budget * 2, device)
    layer = pack.layers[1]
    slots = store.layers[layer.module]
    gate = hold_reads(slots)
    slots.prefetch(np.array([9]))
    time.sleep(0.1)  # the reader is held before it writes the row
    assert not any(op == "copy" for op, _ in device.log), "copied before the read"
    gate.set()
    slots.ensure(np.array([9, 10]))
    assert device_bytes(slots, 9) == record_bytes(pack, layer, 9)
    assert [op for op, _ in device.log].count("executed_copy") == 2
    store.close()


def test_a_host_hit_is_a_copy_not_a_read_and_keeps_its_row_until_copied(small):
    """A device miss that the host tier holds costs one copy and no read (stats.host_hits);
    a hit's row is claimed until its copy is queued, so a read staged in the same call
    never takes it (rule A)."""
    pack, budget = small
    layer = pack.layers[2]
    calls = [[0, 1], [2, 3], [0, 1], [2, 4], [0, 1]]
    runs = {}
    for rows in (2, 4):  # the staging rows alone, then a tier that holds four records
        store = device_store(pack, budget, FakeDevice(), host_rows=rows)
        slots = store.layers[layer.module]
        for experts in calls:
            slots.ensure(np.array(experts))
            for e in experts:
                assert device_bytes(slots, e) == record_bytes(pack, layer, e)
            slots.release()
        runs[rows] = store.snapshot()
        store.close()
    assert runs[2].loads == runs[4].loads == 10 and runs[2].host_hits == 0
    # with four rows: 0 and 1 come back from RAM twice; 2 once (its row outlived 3's)
    assert runs[4].host_hits == 4 + 1
    assert runs[4].bytes_read == (10 - 5) * layer.expert_bytes
    assert runs[2].bytes_read == 10 * layer.expert_bytes


def test_a_hit_claims_its_row_until_its_copy_is_queued(small):
    """Rule A for hits: between a hit (`stage`) and its copy (`queued`) the row is not
    evictable, even by a policy that would choose it; a row being read never is."""
    pack, _ = small
    tier = HostTier(pack.layers[0], 2, HostStreams(), policy="lfu")
    for expert in (0, 1, 1, 1):  # 0 used once, 1 three times: LFU would give up 0
        row, buffers = tier.stage(expert)
        tier.queued(row, None)
    row_0, buffers = tier.stage(0)
    assert buffers is None  # a hit, its copy not queued yet
    row_2, buffers = tier.stage(2)
    assert buffers is not None and row_2 != row_0 and 1 not in tier.row_of
    assert not tier.has_room(3), "one row claimed, the other being read: no room"
    tier.queued(row_0, None)
    assert tier.has_room(3) and tier.stage(3)[0] == row_0  # 2 is still being read
    tier.abandon(row_2, hit=False)
    assert tier.stage(4)[0] == row_2


def test_several_copy_streams_keep_a_refill_from_holding_up_other_copies(small):
    """A refill waiting on compute (rule 2) holds up only its own copy stream: with two
    streams the next refill, whose slot's compute is done, runs at once; with one it
    waits behind the first."""
    pack, budget = small
    layer = pack.layers[0]
    done = {}
    for lanes in (1, 2):
        device = FakeDevice(lanes=lanes, gpu_runs=False)
        store = device_store(pack, budget * 3 // 2, device, policy="lfu", host_rows=4)
        slots = store.layers[layer.module]  # 3 slots
        for _ in range(3):  # experts 1 and 0 in slots 0 and 1, often used
            slots.ensure(np.array([0, 1]))
            slots.release()
        device.finish_compute()
        slots.ensure(np.array([2]))  # slot 2, its compute left pending
        slots.release()
        # LFU gives up 2 (slot 2: its copy waits on that compute), then 0 (slot 1)
        mark = len(device.log)
        slots.prefetch(np.array([4, 5]))
        wait_for(lambda: not slots.fills)
        assert list(slots.slot_of[[4, 5]]) == [2, 1]
        slot_1 = ("executed_copy", slots.memory.device_rows[1].data_ptr())
        done[lanes] = slot_1 in device.log[mark:]
        device.finish_compute()
        assert device_bytes(slots, 5) == record_bytes(pack, layer, 5)
        store.close()
    assert done == {1: False, 2: True}


def test_a_fill_racing_its_prefetch_is_read_once_and_waited_for(small):
    pack, budget = small
    device = FakeDevice()
    store = device_store(pack, budget * 2, device)
    layer = pack.layers[2]
    slots = store.layers[layer.module]
    gate = hold_reads(slots)
    slots.prefetch(np.array([7]))
    done = threading.Event()
    thread = threading.Thread(target=lambda: (slots.ensure(np.array([7, 8])), done.set()))
    thread.start()
    while store.snapshot().late_fills == 0:  # ensure found 7 still filling, and waits
        assert thread.is_alive(), "compute must wait for the prefetched fill"
        time.sleep(0.001)
    assert not done.is_set(), "compute must wait for the prefetched fill"
    gate.set()
    thread.join(5)
    assert done.is_set()
    assert store.stats.late_fills == 1 and store.stats.loads == 2
    copy_of_7 = [e for op, e in device.log if op == "record_copy"]
    assert all(("compute_wait", e) in device.log for e in copy_of_7)
    assert device_bytes(slots, 7) == record_bytes(pack, layer, 7)
    store.close()


def test_reader_errors_surface_as_pack_errors_and_free_the_slot(packs, tmp_path):
    dst = tmp_path / "pack"
    shutil.copytree(packs["qwen3_moe"]["hf"], dst)
    layer = corrupt_record(dst, layer=2, expert=3)
    device = FakeDevice()
    store = device_store(Pack.open(dst), 1.0, device)
    slots = store.layers[layer.module]
    with pytest.raises(PackError, match=r"experts.bin: layer 2 expert 3: checksum mismatch"):
        slots.ensure(np.array([3]))
    assert slots.slot_of[3] == -1 and (slots.state == FREE).all()
    assert not any(op == "copy" for op, _ in device.log), "no copy of a bad record"
    slots.ensure(np.array([4]))
    assert [op for op, _ in device.log].count("copy") == 1
    store.close()


# --- int4 math: the PyTorch reference against MLX -----------------------------------

def quantized(shape, bits=4, group=64, seed=0):
    w = mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))
    words, scales, biases = mx.quantize(w, group, bits)
    as_torch = [torch.from_numpy(np.array(a)) for a in (words, scales, biases)]
    as_torch[0] = as_torch[0].view(torch.int32)
    return (words, scales, biases), as_torch


@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_matches_mlx(bits):
    (words, scales, biases), t = quantized((3, 96, 256), bits)
    expected = np.array(mx.dequantize(words, scales, biases, 64, bits))
    got = int4.dequantize(*t, group_size=64, bits=bits).numpy()
    assert np.abs(got - expected).max() < 1e-6


def test_gather_qmm_matches_mlx_gather_qmm():
    (words, scales, biases), t = quantized((5, 128, 256))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    slots = np.array([[3, 0], [4, 3], [1, 1], [2, 0]])  # (token, k)
    expected = mx.gather_qmm(mx.array(x)[:, None, None], words, scales, biases,
                             rhs_indices=mx.array(slots.astype(np.uint32)), transpose=True,
                             group_size=64, bits=4)
    expected = np.array(expected).reshape(8, 128)
    got = int4.gather_qmm(torch.from_numpy(x), *t, torch.from_numpy(slots.reshape(-1)),
                          torch.arange(4).repeat_interleave(2))
    dense = torch.stack([torch.from_numpy(x[m // 2]) @ int4.dequantize(
        *(a[s] for a in t)).T for m, s in enumerate(slots.reshape(-1))])
    assert (got - dense).abs().max() < 1e-6 * dense.abs().max()  # BLAS blocking aside
    assert np.abs(got.numpy() - expected).max() < 1e-4 * np.abs(expected).max()


@pytest.mark.parametrize("slots_n_k", [(6, 96, 256), (8, 768, 2048), (8, 2048, 768)],
                         ids=["small", "qwen3-30b-a3b gate/up", "qwen3-30b-a3b down"])
def test_triton_kernel_matches_the_reference(slots_n_k):
    """The kernel on a GPU when there is one, else in Triton's interpreter (conftest sets
    TRITON_INTERPRET before anything imports Triton), against MLX's gather_qmm and the
    backend's dequantize-then-matmul, at Qwen3-30B-A3B's expert shapes too: decode's rows
    (one token's top-8 of the pool; the small case two tokens sharing slots). The
    interpreter runs each program in Python, so there the tiles are wider (the same kernel,
    BLOCK_N 256: seconds, not a minute)."""
    if sys.platform != "linux":
        pytest.skip("Triton has wheels for Linux only")
    import triton  # the test extra installs it on Linux: there this test runs, never skips
    from edgemoe.kernels.int4_moe import gather_qmv

    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert device == "cuda" or triton.knobs.runtime.interpret, "Triton is not interpreting"
    s, n, k = slots_n_k
    (words, scales, biases), t = quantized((s, n, k))
    rng = np.random.default_rng(1)
    tokens = 2 if s < 8 else 1
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    slots = np.concatenate([rng.permutation(s)[:min(s, 8)] for _ in range(tokens)])
    rows = np.repeat(np.arange(tokens), len(slots) // tokens)
    mlx_out = mx.gather_qmm(mx.array(x)[mx.array(rows)][:, None, None], words, scales,
                            biases, rhs_indices=mx.array(slots.astype(np.uint32))[:, None],
                            transpose=True, group_size=64, bits=4)
    mlx_out = np.array(mlx_out).reshape(len(slots), n)
    on = lambda a: torch.as_tensor(a).to(device)
    args = (on(x), *(a.to(device) for a in t), on(slots), on(rows))
    got = gather_qmv(*args, block_n=64 if device == "cuda" else 256).cpu().numpy()
    reference = int4.gather_qmm(*args).cpu().numpy()
    scale = np.abs(mlx_out).max()
    assert np.abs(got - mlx_out).max() < 1e-4 * scale
    assert np.abs(got - reference).max() < 1e-4 * scale


# --- whole decodes on the CPU against the MLX path ----------------------------------

PROMPT_LEN, DECODE = 48, 16


def mlx_greedy(model, prompt):
    return gpu_check.mlx_greedy(model, prompt, DECODE)


def prompt(vocab):
    return np.random.default_rng(7).integers(3, vocab, PROMPT_LEN).tolist()


@pytest.fixture(scope="module")
def mlx_runs():
    cache = {}

    def get(path, budget):
        if (path, budget) not in cache:
            model, _ = edgemoe.load(path, expert_budget=budget)
            cache[path, budget] = mlx_greedy(model, prompt(500))
            model.expert_store.close()
        return cache[path, budget]

    return get


@pytest.mark.parametrize("model, budget", [
    ("qwen3_moe", "100%"), ("qwen3_moe", "minimum"), ("mixtral", "minimum"),
    ("olmoe", "minimum"), ("bundled", "100%"), ("bundled", "minimum")])
def test_cpu_logits_match_the_mlx_path(model, budget, packs, mlx_runs):
    path = str(DEFAULT_MODEL if model == "bundled" else packs[model]["hf"])
    amount = 1.0 if budget == "100%" else minimum_bytes(Pack.open(path))
    ref_tokens, ref_logits = mlx_runs(path, amount)
    torch_model, _ = load(path, expert_budget=amount, device="cpu", tokenizer=False)
    run = greedy(torch_model, prompt(500), DECODE)
    stats = torch_model.expert_store.stats
    torch_model.expert_store.close()
    assert run.tokens == ref_tokens
    assert np.abs(run.logits.numpy() - ref_logits).max() < LOGIT_TOLERANCE
    if budget == "minimum":
        assert stats.evictions > 0


@pytest.mark.parametrize("model", ["qwen3_moe", "mixtral", "olmoe", "bundled"])
def test_advisory_routing_prefetches_and_keeps_the_mlx_paths_tokens(model, packs, mlx_runs):
    """Advisory on the CUDA backend (CPU mode): the next layer's router prefetches (gate
    off, so every prediction is read ahead), the router still decides: the MLX path's
    tokens, and the backend's own native logits bit for bit."""
    path = str(DEFAULT_MODEL if model == "bundled" else packs[model]["hf"])
    amount = minimum_bytes(Pack.open(path)) * 2
    ref_tokens, ref_logits = mlx_runs(path, amount)
    runs, stats = {}, {}
    for routing in ("native", "advisory"):
        torch_model, _ = load(path, expert_budget=amount, device="cpu", tokenizer=False, routing=routing)
        torch_model.expert_store.gate_prefetches(routing == "native")
        runs[routing] = greedy(torch_model, prompt(500), DECODE)
        stats[routing] = torch_model.expert_store.snapshot()
        torch_model.expert_store.close()
    assert runs["advisory"].tokens == ref_tokens
    assert np.abs(runs["advisory"].logits.numpy() - ref_logits).max() < LOGIT_TOLERANCE
    assert torch.equal(runs["advisory"].logits, runs["native"].logits)
    assert stats["native"].prefetches == 0 < stats["advisory"].prefetches
    assert stats["advisory"].predicted_used > 0
    assert stats["advisory"].on_demand < stats["native"].on_demand


def test_tiny_model_matches_mlx_lm(packs, checkpoints):
    from mlx_lm.utils import load as mlx_lm_load

    reference, _ = mlx_lm_load(str(checkpoints["qwen3_moe"][1]))
    ref_tokens, ref_logits = mlx_greedy(reference, prompt(500))
    torch_model, _ = load(packs["qwen3_moe"]["hf"], expert_budget=0.5, device="cpu", tokenizer=False)
    run = greedy(torch_model, prompt(500), DECODE)
    assert run.tokens == ref_tokens
    assert np.abs(run.logits.numpy() - ref_logits).max() < LOGIT_TOLERANCE


def test_gpu_check_cannot_pass_vacuously():
    """On a GPU a kernel that did not run fails the check; the bounds are docs/cuda.md's."""
    ok = {"ok": True}
    assert gpu_check.verdict([ok], [ok, ok], cuda=True)
    assert not gpu_check.verdict([ok], [{"skipped": "no Triton (...)", "ok": False}], cuda=True)
    assert not gpu_check.verdict([ok], [{"skipped": "no GPU"}], cuda=True)
    assert not gpu_check.verdict([ok], [], cuda=True)
    assert not gpu_check.verdict([{"ok": False}], [ok], cuda=True)
    assert gpu_check.verdict([ok], [{"skipped": "no GPU"}], cuda=False)  # the CPU dry run
    assert gpu_check.TOLERANCE["float32"]["max_abs_diff"] <= 1e-3  # docs/cuda.md: within 1e-3
    assert gpu_check.TOLERANCE["bfloat16"]["argmax_agreement"] >= 1 - 1 / gpu_check.DECODE
    assert gpu_check._kernel_wanted("cuda") is True and gpu_check._kernel_wanted("cpu") is None


def test_forcing_the_greedy_tokens_changes_nothing(packs):
    """scripts/gpu_check.py compares logits with another run's tokens forced."""
    model, _ = load(packs["qwen3_moe"]["hf"], expert_budget=1.0, device="cpu", tokenizer=False)
    free = greedy(model, prompt(500), 6)
    forced = greedy(model, prompt(500), 6, forced=free.tokens)
    other = greedy(model, prompt(500), 6, forced=[7] * 6)
    model.expert_store.close()
    assert forced.tokens == free.tokens and torch.equal(forced.logits, free.logits)
    assert not torch.equal(other.logits, free.logits)


def test_decode_through_the_fake_device_equals_synchronous_copies(packs):
    """A whole decode under the ordering rules, every wait checked by the fake device,
    gives the same logits as synchronous copies."""
    path = packs["qwen3_moe"]["hf"]
    budget = minimum_bytes(Pack.open(path))
    runs = []
    for streams in (HostStreams(), FakeDevice()):
        model, _ = load(path, expert_budget=budget, device="cpu", streams=streams, tokenizer=False)
        runs.append(greedy(model, prompt(500), 4))
        model.expert_store.close()
    assert runs[0].tokens == runs[1].tokens
    assert torch.equal(runs[0].logits, runs[1].logits)
    assert any(op == "copy_wait" for op, _ in streams.log), "refills waited on compute"


def test_a_host_tier_turns_reads_into_copies_and_changes_no_logit():
    """The bundled model at its minimum budget, with a host tier of half its experts:
    the same logits as the staging rows alone, bit for bit, with fewer bytes read; every
    load is a host hit or a read (through the fake device's ordering too)."""
    path = DEFAULT_MODEL
    budget = minimum_bytes(Pack.open(path))
    runs, stats = {}, {}
    for host_budget, streams in ((None, HostStreams()), ("50%", HostStreams()),
                                 ("50%", FakeDevice(lanes=2))):
        model, _ = load(path, expert_budget=budget, device="cpu", streams=streams, tokenizer=False,
                        host_budget=host_budget)
        tier = model.expert_store.pool(model.expert_store.layer_indices[0]).memory.host
        key = (host_budget, type(streams).__name__)
        runs[key] = greedy(model, prompt(500), 8)
        stats[key] = (model.expert_store.snapshot(), tier.num_rows)
        model.expert_store.close()
    staging, tier, fake = stats.values()
    assert staging[1] == Pack.open(path).top_k and tier[1] == Pack.open(path).layers[0].num_experts // 2
    logits = [r.logits for r in runs.values()]
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])
    assert staging[0].loads == tier[0].loads  # the device slots see the same misses
    assert tier[0].host_hits > 0 and staging[0].host_hits < tier[0].host_hits
    expert_bytes = Pack.open(path).layers[0].expert_bytes
    assert tier[0].bytes_read == (tier[0].loads - tier[0].host_hits) * expert_bytes
    assert tier[0].bytes_read < staging[0].bytes_read
    assert fake[0].host_hits == tier[0].host_hits


@pytest.mark.parametrize("options", ["", ", adapter_path='pack'"], ids=["plain", "adapter"])
def test_the_backend_runs_without_mlx(options):
    script = (
        "import sys; sys.modules.update(mlx=None, mlx_lm=None)  # importing them fails\n"
        "from edgemoe.cuda import load, greedy\n"
        f"model, _ = load(expert_budget=0.25, device='cpu', tokenizer=False{options})\n"
        "print(len(greedy(model, [5, 6, 7], 2).tokens))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "2", out.stderr


def test_the_core_never_imports_the_backend():
    package = Path(edgemoe.__file__).parent
    offenders = []
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")]
                names += [f"{names[0]}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            if any(n in (".cuda", ".kernels") or "cuda" in n.split(".")
                   or n.split(".")[-1] == "kernels" or n.startswith(("torch", "triton"))
                   for n in names):
                offenders.append(f"{path.name}: {names}")
    # the one exception: `train_lora --backend torch` imports the PyTorch trainer when chosen
    allowed = ["train_lora.py: ['.cuda.train', '.cuda.train.distil']"]
    assert offenders == allowed


@pytest.mark.parametrize("field, value", [("first_layer", True), ("history", 2),
                                          ("inputs", 2), ("depth", 2), ("head_hidden", 64)])
def test_heads_of_a_removed_variant_are_refused_in_one_line(tmp_path, field, value):
    """Heads saved with a removed variant's field (#44) load at its plain value only: any
    other names the file and the field, as on the MLX path."""
    import json

    from edgemoe.cuda.prerouted import load_heads
    from edgemoe.mlx_backend.prerouter import CONFIG, WEIGHTS

    (tmp_path / CONFIG).write_text(json.dumps({
        "model_type": "qwen3_moe", "hidden_size": 8, "num_experts": 4, "top_k": 2,
        "sources": {"0": 1, "1": 0}, field: value}))
    (tmp_path / WEIGHTS).write_bytes(b"")
    with pytest.raises(ValueError, match=f"{field} {value}: heads of a variant removed") as e:
        load_heads(tmp_path, "cpu")
    assert str(tmp_path / CONFIG) in str(e.value) and "\n" not in str(e.value)
