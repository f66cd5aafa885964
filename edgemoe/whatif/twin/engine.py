"""The twin's run: the real store, readers, slots and policy; compute replaced by waits.

One forward call of the trace, layer by layer, as edgemoe.mlx_backend.experts.StreamingExperts
drives the store (module doc of edgemoe.whatif.twin):

    look_ahead(pool, entries)                    a long prefill's first pass (native)
    wait(resident compute of the layer)          attention, router, shared expert
    wait(host sync)                              routing learned by the host (native,
                                                 advisory; not prerouted decode)
    run_call(pool, ids, compute, routed)         edgemoe.streaming.calls, the real one:
        ensure -> routed(): prefetches -> compute: wait(experts) + wait(host sync) -> release
    prerouted: prefetch the next token's experts
    ... every layer, then wait(lm_head) + wait(host sync) (the sampled token)

Waits are `time.sleep`, which releases the GIL as MLX's evaluation does, so reader threads
run beside them. A sleep that overshoots is paid back from the next waits (`Waiter`), so
the compute total is what the model says. Everything times `stretch`: this disk's seconds
per record over the profile's, so that reads and compute keep the profile's ratio; the
Python between waits (which runs at this CPU's speed and is not stretched by itself) gets
an extra wait of (stretch / cpu_vs_here - 1) x its duration, so it too counts as it would
on the profile's CPU. Forecast seconds = twin seconds / stretch. This disk's speed drifts
(shared/GUIDE.md): the stretch starts from a probe and then follows the readers' own time
per record, call by call (`track_disk`); each call's seconds are divided by the stretch it
ran under.
"""

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from ...format.pack import Pack
from ...routing.modes import routing_mode
from ...streaming.budget import SlotPlan
from ...streaming.calls import run_call
from ...streaming.prefill_ahead import look_ahead
from ...streaming.store import ExpertStore
from ..replay import recorded_prefetches, trace_calls
from .compute import Compute, Waiter
from .profiles import Profile, measure_reads
from .readers import CpuCountedReader, TwinReader, memory_factory, without_checksums

@dataclass
class TwinConfig:
    budget: str = "25%"
    mode: str = "native"  # native | advisory | prerouted (edgemoe.routing.modes' names)
    policy: str = "lfu"
    io: str = "direct"
    readers: int = 2
    stretch: Optional[float] = None  # None: measured (this disk over the profile's SSD)
    recall: float = 0.8  # advisory's synthetic predictor, where the trace recorded none
    seed: int = 0
    dilate_python: bool = True
    track_disk: bool = True  # with a measured stretch: follow this disk's speed call by call
    cpu_vs_here: Optional[float] = None  # None: the profile's figure
    mac_reads: bool = True  # read as macOS does (TwinReader); False: this machine's reader
    # host syncs per MoE layer in decode: None is the decode path's own (edgemoe.mlx_backend.
    # hostsync): a streamed layer reads its routing back (1), a layer whose every expert
    # is in its slots looks them up on the device (0), prerouted decode knows its routing
    # a token ahead (0: its one sync a token is the first layer's, which has no head).
    # 2 is the path before it (a routing read and an evaluation after the experts;
    # prerouted kept the second). Set it to forecast another path.
    syncs_per_layer: Optional[int] = None
    # the real run recorded a trace (a validation): a layer held whole syncs on its routing
    # too (edgemoe.mlx_backend.experts keeps the device lookup for untraced runs), so its
    # resident run syncs as its streamed ones do
    traced: bool = False
    # prerouted decode (edgemoe.routing.heads_config, prerouted_layers): the MoE layers (by
    # model index) whose routing the heads give a token ahead (None: all but the first,
    # plain heads); those routed cache-conditionally, whose router chooses after one more
    # evaluation (its restricted logits: edgemoe.mlx_backend.conditional.ConditionalTap). Every
    # other layer syncs on its routing, held whole or not.
    heads_layers: Optional[Tuple[int, ...]] = None
    conditional_layers: Tuple[int, ...] = ()
    # compute runs on this CPU, beside the reader threads (a validation here, with this
    # machine's reader): the reader's CPU seconds during a compute wait extend the wait
    reader_contends: bool = False
    busy_compute: bool = False  # compute waits keep a core busy (Waiter's `busy`)
    # with a slot for every expert, a layer reads all of them after its first call, as
    # mlx-lm holds them (LayerSlots.read_whole, which the MLX decode path sets); False:
    # each on its first use (the store's default, a replay's)
    read_whole: bool = True
    skip_decode_calls: int = 0  # decode figures from this decode call on (bench_stream's
    # counters start once the first token is out, when the next call has already run)
    # a long prefill reads each layer's first pass while its attention computes
    # (edgemoe.streaming.prefill_ahead); False: the path before it
    look_ahead: bool = True


@dataclass
class TwinResult:
    config: dict
    profile: str
    compute_method: str
    stretch: float
    tokens: int
    decode_tokens: int
    prefill_tokens: int
    twin_decode_s: float
    twin_prefill_s: float
    forecast_decode_tok_s: float
    forecast_prefill_s: float
    forecast_ttft_s: float  # every call before the decode window (skip_decode_calls)
    decode_bytes: int
    total_bytes: int
    decode_bytes_per_token: float
    blocked_ms_per_token: float  # forecast ms (twin / stretch)
    compute_ms_per_token: float  # forecast ms of the profile's compute (and syncs) per token
    python_ms_per_token: float  # forecast ms of the Python between waits (real x pad / stretch)
    host_syncs_per_token: float
    hit_rate: float
    slots_per_layer: int
    read_gbps_during_run: float
    probe: dict = field(default_factory=dict)
    waits: dict = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def probe_stretch(pack: Pack, profile: Profile, readers: int, io: str) -> dict:
    """This disk's seconds per record (random records of the pack, `readers` threads) over
    the profile's."""
    rec = pack.layers[0].expert_bytes
    n = max(16, min(96, int(2e9 // rec)))
    here = min((measure_reads(pack.files[0], rec, reads=n, threads=readers,
                              direct=io == "direct", seed=i) for i in range(2)),
               key=lambda m: m["s_per_record"])
    there = profile.read_s(rec, readers)  # wall per record, `readers` in flight
    return {"here_s_per_record": here["s_per_record"], "here_gbps": here["gbps"],
            "profile_s_per_record": there, "stretch": here["s_per_record"] / there}


def run_twin(pack: Pack, trace: Dict[str, np.ndarray], compute: Compute, profile: Profile,
             cfg: TwinConfig) -> TwinResult:
    """Replay `trace` (already mapped onto `pack`'s layers) through a real ExpertStore."""
    notes = []
    routed, decode = trace["routed"], trace["decode"].astype(bool)
    calls = trace_calls(trace)
    probe = {}
    if cfg.stretch is not None:
        stretch = cfg.stretch
    else:
        probe = probe_stretch(pack, profile, cfg.readers, cfg.io)
        stretch = probe["stretch"]
    slots = SlotPlan.of(pack).slots(cfg.budget)  # the store's own rule
    factory, shared = memory_factory(pack, slots)
    if shared:
        notes.append("slot rows shared by layers (pools too large for memory here)")
    if cfg.mac_reads:
        pack = without_checksums(pack)  # the CRC32 is a wait of the profile's (TwinReader)
        reader = TwinReader(pack, cfg.readers, cfg.io)
        reader.crc_s_per_byte = 1 / (profile.value("crc32_gbps") * 1e9)
    else:  # this machine's own reader path: staging copy and real CRC32s
        reader = CpuCountedReader(pack, cfg.readers, cfg.io)
    store = ExpertStore(pack, cfg.budget, cfg.policy, io=cfg.io, readers=cfg.readers,
                        memory=factory, reader=reader)
    for layer in store.layer_indices:
        store.pool(layer).read_whole = cfg.read_whole
    try:
        return _replay(store, trace, routed, decode, calls, compute, profile, cfg, stretch,
                       probe, notes)
    finally:
        store.close()


def layer_syncs(pool, mode, known: bool, traced: bool) -> bool:
    """Whether a decode call of this layer reads its routing back, as
    edgemoe.mlx_backend.experts.StreamingExperts does: not when the heads gave it; a prerouted
    model's other layers always (the resident shortcut is native and advisory's); a
    native or advisory layer when streamed, or when the run is traced."""
    if known:
        return False
    if mode.routes:
        return True
    return traced or pool.num_slots < pool.layer.num_experts


def prerouted_layers(heads) -> dict:
    """TwinConfig's heads_layers and conditional_layers for the prerouter folder `heads`
    (its prerouter_config.json, what `--routing prerouted` runs)."""
    from ...routing.heads_config import read_config
    config = read_config(heads)
    predicted = tuple(config.predicted_layers)
    if config.conditional:
        return {"heads_layers": (), "conditional_layers": predicted}
    return {"heads_layers": predicted, "conditional_layers": ()}


def _reader_cpu(reader) -> Callable[[], float]:
    """The reader's CPU seconds so far: counted per thread where it counts them, else its
    copy and CRC32 time."""
    if isinstance(reader, CpuCountedReader):
        return lambda: reader.cpu_s
    return lambda: reader.verify_s


def _prefetch_table(trace) -> Dict[tuple, list]:
    return recorded_prefetches(trace)


def _replay(store, trace, routed, decode, calls, compute, profile, cfg, stretch, probe, notes):
    pools = [store.pool(i) for i in store.layer_indices]
    L = len(pools)
    stats = store.stats
    cpu = cfg.cpu_vs_here if cfg.cpu_vs_here is not None else profile.value("cpu_vs_here")
    python_factor = stretch / cpu if cfg.dilate_python else 1.0
    waiter = Waiter(stretch, python_factor, blocked=lambda: stats.blocked_s,
                    contending=_reader_cpu(store.reader) if cfg.reader_contends else None,
                    busy=cfg.busy_compute)
    if cfg.mac_reads:
        store.reader.stretch = stretch
    mode = routing_mode(cfg.mode)
    recorded = _prefetch_table(trace) if mode.predicts else {}
    synthetic = mode.predicts and not recorded
    if synthetic:
        notes.append(f"{mode}: predictions synthesized from the trace ("
                     + ("the next token's routing, exact: the prediction is the routing"
                        if mode.routes else
                        f"the next layer's experts of the same token at recall {cfg.recall}")
                     + ")")
    store.gate_prefetches(mode.gates_prefetches)
    rng = np.random.default_rng(cfg.seed)
    num_experts = pools[0].layer.num_experts
    decode_calls = [i for i, c in enumerate(calls) if decode[c.start]]
    first_decode = (decode_calls[cfg.skip_decode_calls]
                    if len(decode_calls) > cfg.skip_decode_calls else len(calls))

    def issue(c, position):
        for target, lead, ids in recorded.get((c, position), ()):
            store.prefetch(target, np.asarray(ids), lead)

    def advise(c, p):  # the next layer's experts of this call, at `recall`
        if p + 1 >= L:
            return
        true = np.unique(routed[calls[c], p + 1])
        keep = true[rng.random(len(true)) < cfg.recall]
        others = np.setdiff1d(np.arange(num_experts), true)
        wrong = rng.choice(others, min(len(true) - len(keep), len(others)), replace=False)
        store.prefetch(p + 1, np.concatenate([keep, wrong]), 0)

    def preroute(c, p):  # the next token's experts of the next layer: the routing itself
        if c + 1 >= len(calls) or not decode[calls[c + 1].start]:
            return
        target, lead = (p + 1, 1) if p + 1 < L else (0, 0)
        store.prefetch(target, np.unique(routed[calls[c + 1], target]), lead)

    first = min(pool.layer.index for pool in pools)
    by_heads = (lambda layer: layer != first) if cfg.heads_layers is None else \
        (lambda layer: layer in cfg.heads_layers)
    record_bytes = pools[0].layer.expert_bytes
    profile_s = profile.read_s(record_bytes, cfg.readers)
    track = cfg.stretch is None and cfg.track_disk
    last_busy, last_bytes = store.reader.busy_s, 0
    stretches = []
    acc = {k: 0.0 for k in ("decode_s", "prefill_s", "ttft_s", "blocked", "compute", "python")}
    dec_before = None
    twin_s = [0.0, 0.0]  # twin seconds: decode, prefill
    for c, call in enumerate(calls):
        is_decode = bool(decode[call.start])
        if c == first_decode:
            dec_before = store.snapshot()
        if track:  # this disk's time per record over the last reads, smoothed
            busy, done = store.reader.busy_s, stats.bytes_read
            if done - last_bytes >= 16 * record_bytes:
                here = (busy - last_busy) / ((done - last_bytes) / record_bytes)
                stretch = 0.5 * stretch + 0.5 * min(max(here / profile_s, 0.05), 100.0)
                last_busy, last_bytes = busy, done
            waiter.stretch = stretch
            waiter.python_factor = stretch / cpu if cfg.dilate_python else 1.0
        if cfg.mac_reads:
            store.reader.stretch = stretch
        stretches.append(stretch)
        marks = (waiter.compute, waiter.python_s + waiter.python_pad, stats.blocked_s)
        tic = time.perf_counter()
        tokens = call.stop - call.start
        issue(c, -1)
        predicted = (mode.routes and is_decode and c > 0
                     and bool(decode[calls[c - 1].start]))
        syncs = 2 if not is_decode else cfg.syncs_per_layer
        for p, pool in enumerate(pools):
            known = predicted and by_heads(pool.layer.index)
            if syncs is None:  # today's path (layer_syncs)
                routing_sync = layer_syncs(pool, mode, known, cfg.traced)
                experts_sync = False
            else:
                routing_sync = not known and syncs >= 1
                experts_sync = syncs >= 2 or (known and syncs >= 1)
            if cfg.look_ahead and not mode.predicts:  # as the model, before the sync
                look_ahead(pool, routed[call, p].size)
            waiter.wait(compute.resident_layer_s(tokens))
            if mode.predicts and p + 1 < L:  # the predictor of the next layer runs here
                waiter.wait(compute.heads_s(tokens))
            if predicted and pool.layer.index in cfg.conditional_layers:
                # its restricted logits, evaluated in the router (not a sync of the
                # expert path: the store's count, which the twin's matches, leaves it out)
                waiter.wait(compute.host_sync_s)
            if routing_sync:
                waiter.wait(compute.host_sync_s + compute.sync_idle_s)
                stats.host_syncs += 1
            ids = routed[call, p]

            def compute_pass(rows, slot_ids, ids=ids):
                entries = ids.size if rows is None else len(rows)
                # (distinct slots by a count, not a sort: this is the twin's own Python,
                # which a pass of a long prefill would otherwise charge to the model's)
                n = int(np.count_nonzero(np.bincount(slot_ids.reshape(-1))))
                waiter.wait(compute.experts_s(n, entries))
                if experts_sync:
                    waiter.wait(compute.host_sync_s
                                + (0.0 if routing_sync else compute.sync_idle_s))
                    stats.host_syncs += 1

            def on_routed(c=c, p=p, known=known):
                if not known:  # its prefetches overlap its compute (StreamingExperts)
                    issue(c, p)
                if synthetic and mode.advisory:
                    advise(c, p)

            run_call(pool, ids, compute_pass, on_routed)
            if known:  # deferred to the next sync, after this layer's compute
                issue(c, p)
            if mode.routes and is_decode and synthetic:
                preroute(c, p)
        waiter.wait(compute.head_s)
        waiter.wait(compute.host_sync_s)
        took = time.perf_counter() - tic
        # forecast seconds: this call's twin seconds over the stretch it ran under
        if c < first_decode:  # before the decode window: the time to the first token
            acc["ttft_s"] += took / stretch
        if not is_decode:
            acc["prefill_s"] += took / stretch
        elif c >= first_decode:
            acc["decode_s"] += took / stretch
        twin_s[0 if is_decode else 1] += took
        counted = is_decode and c >= first_decode
        if counted:
            acc["compute"] += (waiter.compute - marks[0]) / stretch
            acc["python"] += (waiter.python_s + waiter.python_pad - marks[1]) / stretch
            acc["blocked"] += (stats.blocked_s - marks[2]) / stretch
    total = store.snapshot()
    d = total - dec_before if dec_before is not None else total
    counted = [c for i, c in enumerate(calls) if decode[c.start] and i >= first_decode]
    n_dec = sum(c.stop - c.start for c in counted)
    n_calls_dec = len(counted)
    notes.append(f"waits: asked {waiter.asked:.2f} s, slept {waiter.slept:.2f} s; Python "
                 f"between waits {waiter.python_s:.2f} s, padded by {waiter.python_pad:.2f} s")
    dec_s = acc["decode_s"]
    return TwinResult(
        config=asdict(cfg), profile=profile.name, compute_method=compute.method,
        stretch=float(np.mean(stretches)) if stretches else stretch, tokens=len(routed),
        decode_tokens=n_dec, prefill_tokens=int((~decode).sum()),
        twin_decode_s=twin_s[0], twin_prefill_s=twin_s[1],
        forecast_decode_tok_s=n_dec / dec_s if dec_s else 0.0,
        forecast_prefill_s=acc["prefill_s"], forecast_ttft_s=acc["ttft_s"],
        decode_bytes=int(d.bytes_read), total_bytes=int(total.bytes_read),
        decode_bytes_per_token=d.bytes_read / max(n_dec, 1),
        blocked_ms_per_token=1000 * acc["blocked"] / max(n_dec, 1),
        compute_ms_per_token=1000 * acc["compute"] / max(n_dec, 1),
        python_ms_per_token=1000 * acc["python"] / max(n_dec, 1),
        host_syncs_per_token=d.host_syncs / max(n_calls_dec, 1), hit_rate=d.hit_rate,
        slots_per_layer=store.slots_per_layer, read_gbps_during_run=d.read_gbps,
        probe=dict(probe, stretch_min=float(min(stretches, default=stretch)),
                   stretch_max=float(max(stretches, default=stretch))),
        waits={"reader_busy_s": d.read_busy_s, "reader_verify_s": d.verify_s,
               "blocked_s": d.blocked_s, "loads": d.loads, "on_demand": d.on_demand,
               "asked_s": waiter.asked, "slept_s": waiter.slept,
               "python_s": waiter.python_s, "python_pad_s": waiter.python_pad,
               "reader_cpu_during_compute_s": waiter.contended},
        notes=notes)
