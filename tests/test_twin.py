"""The twin (edgemoe.whatif.twin): profiles are cited data, a replay reads what cache_sim says, and
the wait model scales as the profile says. Tiny shapes: the whole file runs in seconds."""

import json
import time
from pathlib import Path

import numpy as np
import pytest

from edgemoe.whatif.replay import simulate
from edgemoe.whatif.twin.compute import Compute, Waiter
from edgemoe.whatif.twin.engine import TwinConfig, run_twin
from edgemoe.whatif.twin.profiles import KINDS, Profile, all_profiles, load_profile
from edgemoe.whatif.twin.shapes import (SHAPES, map_trace, open_shape_pack, tiny_shape,
                                 write_shape_pack)

ROOT = Path(__file__).resolve().parents[1]
NAMED = ("m4-pro-24gb", "m4-max-128gb", "m3-max-48gb", "m4-air-24gb")


def synthetic_trace(layers=3, experts=16, k=2, prompt=24, decode=24, seed=0):
    """Skewed routing (a few hot experts), a prompt call then one call per decoded token."""
    rng = np.random.default_rng(seed)
    p = 1 / np.arange(1, experts + 1) ** 1.1
    p /= p.sum()
    n = prompt + decode
    routed = np.stack([[rng.choice(experts, k, replace=False, p=p) for _ in range(layers)]
                       for _ in range(n)]).astype(np.int32)
    return {"layers": np.arange(layers, dtype=np.int32), "routed": routed,
            "decode": np.array([False] * prompt + [True] * decode),
            "calls": np.array([prompt] + [1] * decode, dtype=np.int32),
            "expert_bytes": np.full(layers, 1, dtype=np.int64),
            "num_experts": np.full(layers, experts, dtype=np.int32)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    shape = tiny_shape(layers=3, experts=16, top_k=2)
    folder = write_shape_pack(shape, tmp_path_factory.mktemp("twin") / "pack", 2)
    return shape, open_shape_pack(folder, shape)


def zero_compute(sync_s=0.0):
    return Compute(lambda t: 0.0, lambda n, e: 0.0, 0.0, sync_s, "zero")


def test_profiles_load_and_every_figure_has_a_source():
    profiles = all_profiles()
    for name in NAMED:
        assert name in profiles
    for p in profiles.values():
        for key, fig in p.figures.items():
            assert fig["source"].strip(), (p.name, key)
            assert fig["kind"] in KINDS, (p.name, key)
            if fig["kind"] == "unsourced":
                assert "unsourced" in fig["source"], (p.name, key)
    assert load_profile("m4-pro-24gb").ssd_gbps > 1


def test_a_profile_without_a_source_is_refused(tmp_path):
    d = json.loads(json.dumps(load_profile("m4-pro-24gb").to_json()))
    d["figures"]["int4_gbps"]["source"] = ""
    path = tmp_path / "p.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="int4_gbps"):
        load_profile(str(path))


def test_shapes_have_the_published_record_sizes():
    assert SHAPES["qwen3-30b-a3b"].record_bytes == 2654208  # 2.53 MiB (shared/GUIDE.md)
    assert 1.6e9 < SHAPES["qwen3-30b-a3b"].active_bytes_per_token < 1.8e9
    assert 20e6 < SHAPES["deepseek-v3"].record_bytes < 26e6


@pytest.mark.parametrize("policy,budget", [("lfu", "25%"), ("lfu", "13%")])
def test_replay_reads_exactly_the_bytes_cache_sim_says(tiny, policy, budget):
    shape, pack = tiny
    trace = map_trace(synthetic_trace(), shape)
    # (cache_sim replays demand reads and the passes' read-ahead; a long prefill's
    # look-ahead, edgemoe.streaming.prefill_ahead, guesses, and a cold guess can miss)
    r = run_twin(pack, trace, zero_compute(), load_profile("m4-pro-24gb"),
                 TwinConfig(budget=budget, policy=policy, io="buffered", stretch=1.0,
                            look_ahead=False))
    sim = simulate(trace, budget, policy)
    assert r.total_bytes == sim.bytes_read
    assert r.decode_bytes == sim.decode_bytes_read
    assert r.total_bytes > 0


def test_map_trace_keeps_top_k_distinct_and_in_range():
    trace = synthetic_trace(layers=2, experts=16, k=2)
    wide = tiny_shape(layers=5, experts=64, top_k=8)
    m = map_trace(trace, wide)
    assert m["routed"].shape == (48, 5, 8)
    assert m["routed"].max() < 64
    assert all(len(set(row)) == 8 for row in m["routed"].reshape(-1, 8).tolist())
    # layer l takes trace layer l mod 2: equal trace rows give equal mapped rows
    same = tiny_shape(layers=2, experts=16, top_k=2)
    one = map_trace(trace, same)
    counts = lambda a: np.sort(np.bincount(a.reshape(-1), minlength=16))  # noqa: E731
    assert (counts(one["routed"][:, 0]) == counts(trace["routed"][:, 0])).all()


def test_waits_scale_with_the_compute_figure_and_the_stretch():
    p = load_profile("m4-pro-24gb")
    shape = SHAPES["qwen3-30b-a3b"]
    c1 = Compute.from_profile(p, shape)
    slow = Profile(p.name, p.chip, json.loads(json.dumps(p.figures)))
    slow.figures["int4_gbps"]["value"] = p.value("int4_gbps") / 2
    c2 = Compute.from_profile(slow, shape)
    assert c2.experts_s(8, 8) == pytest.approx(2 * c1.experts_s(8, 8))
    assert c2.resident_layer_s(1) == pytest.approx(2 * c1.resident_layer_s(1))
    assert c2.head_s == pytest.approx(2 * c1.head_s)
    for stretch in (1.0, 3.0):
        w = Waiter(stretch, python_factor=1.0)
        w.wait(0.002)
        w.wait(0.003)
        assert w.asked == pytest.approx(0.005 * stretch)
        assert w.slept >= 0.005 * stretch * 0.95
    cpu = {}
    for busy in (False, True):  # compute on this CPU: the wait keeps a core busy
        w, tic = Waiter(1.0, busy=busy), time.process_time()
        w.wait(0.03)
        assert w.slept >= 0.03 * 0.95
        cpu[busy] = time.process_time() - tic
    assert cpu[True] > max(0.001, 4 * cpu[False])  # (what a loaded machine leaves it)


def test_twin_compute_per_token_follows_the_profile(tiny):
    shape, pack = tiny
    trace = map_trace(synthetic_trace(decode=12), shape)
    prof = load_profile("m4-pro-24gb")
    base = Compute(lambda t: 1e-3, lambda n, e: 1e-3 * n / 2, 0.0, 0.0, "test")
    runs = {}
    for name, compute, stretch in (("base", base, 1.0), ("double", base.scaled(2.0), 1.0),
                                   ("stretched", base, 2.0)):
        cfg = TwinConfig(budget="100%", io="buffered", stretch=stretch, dilate_python=False)
        runs[name] = run_twin(pack, trace, compute, prof, cfg)
    per_token = 3 * (1e-3 + 1e-3) * 1000  # ms: 3 layers x (resident + 2 experts)
    assert runs["base"].compute_ms_per_token == pytest.approx(per_token, rel=1e-6)
    assert runs["double"].compute_ms_per_token == pytest.approx(2 * per_token, rel=1e-6)
    # stretched: the twin waits twice as long, and the forecast divides it back out
    assert runs["stretched"].compute_ms_per_token == pytest.approx(per_token, rel=1e-6)
    assert runs["stretched"].waits["asked_s"] == pytest.approx(2 * runs["base"].waits["asked_s"])
    assert runs["stretched"].waits["slept_s"] >= 0.95 * runs["stretched"].waits["asked_s"]
    # forecast tok/s: at most what compute alone allows
    assert runs["base"].forecast_decode_tok_s <= 1000 / per_token * 1.01


def test_prerouted_skips_the_routing_sync_and_advisory_keeps_it(tiny):
    shape, pack = tiny
    trace = map_trace(synthetic_trace(decode=10), shape)
    prof = load_profile("m4-pro-24gb")
    def syncs(mode, budget="50%", per_layer=None):
        return run_twin(pack, trace, zero_compute(), prof,
                        TwinConfig(budget=budget, mode=mode, io="buffered", stretch=1.0,
                                   syncs_per_layer=per_layer)).host_syncs_per_token

    # today's path (edgemoe.mlx_backend.hostsync): a streamed layer reads its routing back once,
    # a layer held whole none, prerouted decode syncs once a token
    assert syncs("native") == pytest.approx(3)
    assert syncs("advisory") == pytest.approx(3)
    # (the first decoded token has no prediction yet: a streamed layer's sync each)
    assert syncs("prerouted") == pytest.approx((9 * 1 + 3) / 10)
    assert syncs("native", "100%") == pytest.approx(0)
    assert syncs("native", per_layer=2) == pytest.approx(2 * 3)  # the path before it


def test_syncs_follow_a_traced_run_and_the_heads_config(tiny):
    """A validation's real runs are traced, and a traced layer held whole reads its routing
    back too: the twin of its 100% run (the calibration) syncs as the streamed runs do, so
    their syncs are not counted twice. Prerouted syncs follow the heads' config: the
    shipped cache-conditional layers read their routing back, after one more evaluation."""
    shape, pack = tiny
    trace = map_trace(synthetic_trace(decode=10), shape)
    prof = load_profile("m4-pro-24gb")

    def run(mode, budget, **kw):
        return run_twin(pack, trace, zero_compute(1e-3), prof,
                        TwinConfig(budget=budget, mode=mode, io="buffered", stretch=1.0,
                                   dilate_python=False, **kw))

    assert run("native", "100%").host_syncs_per_token == 0
    assert run("native", "100%", traced=True).host_syncs_per_token == 3
    # heads on layer 2 alone: layers 0 and 1 read theirs, from the second decoded token on
    assert run("prerouted", "50%", heads_layers=(2,)).host_syncs_per_token == \
        pytest.approx((9 * 2 + 3) / 10)
    # cache-conditional layers 1 and 2 (layer 0 native): every layer syncs, held whole too,
    # and each conditional layer evaluates its restricted logits first
    plain = run("prerouted", "100%", heads_layers=(), conditional_layers=())
    conditional = run("prerouted", "100%", heads_layers=(), conditional_layers=(1, 2))
    assert conditional.host_syncs_per_token == plain.host_syncs_per_token == 3
    assert conditional.compute_ms_per_token - plain.compute_ms_per_token == \
        pytest.approx(2 * 1.0 * 9 / 10)


def test_a_full_budget_reads_every_expert_after_the_first_call(tiny):
    """At 100% the MLX decode path reads a layer's every expert once its first call is done
    (LayerSlots.read_whole), as mlx-lm holds them: the twin too, or it would read first
    uses inside the decode window that the real run read during the prompt."""
    shape, pack = tiny
    trace = map_trace(synthetic_trace(decode=10), shape)
    prof = load_profile("m4-pro-24gb")
    every = sum(r.length for layer in pack.layers for r in layer.records)

    def total(read_whole):
        return run_twin(pack, trace, zero_compute(1e-3), prof,
                        TwinConfig(budget="100%", io="buffered", stretch=1.0,
                                   read_whole=read_whole)).total_bytes

    assert total(True) == every > total(False)


def test_a_validation_run_reports_what_other_processes_took():
    """bench_stream's worker (the validation's real runs) reports its own CPU and the cores
    other processes took beside it: on 2 cores one busy neighbour is half the machine."""
    import sys
    from collections import namedtuple
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_stream
    times = namedtuple("times", "user system")
    out = bench_stream.cpu_during(2.0, times(1.0, 0.5), times(2.5, 1.0), (100.0, 1.0),
                                  (104.0, 1.2))
    assert out == pytest.approx({"cpu_cores": 1.0, "others_cores": 1.0, "steal_cores": 0.1})
    busy, steal = bench_stream.machine_cpu_s()
    assert busy > 0 and steal >= 0


def test_the_bundled_heads_route_cache_conditionally():
    from edgemoe.routing.heads_config import read_config
    from edgemoe.whatif.twin.engine import prerouted_layers
    heads = ROOT / "edgemoe" / "models" / "fine" / "prerouter"
    config = read_config(heads)
    layers = prerouted_layers(heads)
    assert config.conditional and layers["heads_layers"] == ()
    assert layers["conditional_layers"] == tuple(config.predicted_layers) != ()


def test_doctor_machine_prints_a_labelled_forecast(capsys, tmp_path):
    from edgemoe.doctor import main
    from edgemoe.format.source import BUNDLED_MODEL
    from edgemoe.streaming.trace import load_trace
    trace = load_trace("edgemoe/models/fine/traces/stdlib.npz")
    short = {k: v for k, v in trace.items() if not k.startswith("prefetch")}
    decoded = np.cumsum(trace["decode"])  # the prompt and the first 32 decoded tokens
    end = int(np.searchsorted(decoded, 32)) + 1
    ends = np.cumsum(trace["calls"])
    short.update(routed=trace["routed"][:end], decode=trace["decode"][:end],
                 calls=trace["calls"][:int(np.searchsorted(ends, end)) + 1])
    path = tmp_path / "short.npz"
    with open(path, "wb") as f:
        np.savez_compressed(f, **short)
    main(["--machine", "m4-pro-24gb", "--model", str(BUNDLED_MODEL), "--trace", str(path),
          "--expert-budget", "25%"])
    out = capsys.readouterr().out
    assert "FORECAST" in out and "unvalidated" in out
    assert "fits in 24.0 GB" in out
    assert "unsourced" in out  # the profile says which figures nobody published


def test_shape_from_config_matches_the_named_a3b_shape():
    from edgemoe.whatif.twin.shapes import shape_from_config
    config = {"hidden_size": 2048, "moe_intermediate_size": 768, "num_experts": 128,
              "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_attention_heads": 32,
              "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936}
    s = shape_from_config(config)
    named = SHAPES["qwen3-30b-a3b"]
    assert s.record_bytes == named.record_bytes
    assert s.active_bytes_per_token == pytest.approx(named.active_bytes_per_token, rel=1e-6)


def test_this_machines_reader_path_reads_the_same_bytes(tiny):
    """--validate replays with this machine's own reader (staging copy, real CRC32s)."""
    shape, pack = tiny
    trace = map_trace(synthetic_trace(), shape)
    prof = load_profile("m4-pro-24gb")
    # (without the look-ahead, as the test above: with zero compute, whether a guess that
    # missed was begun before its call cancelled it is a race)
    got = [run_twin(pack, trace, zero_compute(), prof,
                    TwinConfig(budget="25%", io="buffered", stretch=1.0, mac_reads=mac,
                               look_ahead=False)
                    ).total_bytes for mac in (True, False)]
    assert got[0] == got[1] == simulate(trace, "25%", "lfu").bytes_read


def test_this_machines_reader_counts_its_threads_cpu(tiny):
    """The validation's contention term takes the reader threads' CPU seconds, preadv
    included (CpuCountedReader), not only the copy and CRC32 time."""
    import time
    from edgemoe.streaming.store import ExpertStore
    from edgemoe.whatif.twin.readers import CpuCountedReader, ScratchMemory
    _, pack = tiny
    reader = CpuCountedReader(pack, 2, "buffered")
    store = ExpertStore(pack, "25%", "lfu", io="buffered", readers=2, reader=reader,
                        memory=lambda layer, n: ScratchMemory(layer, n))
    try:
        assert reader.cpu_s == 0.0
        store.prefetch(0, np.arange(2), 0)
        deadline = time.monotonic() + 10
        while store.snapshot().bytes_read == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.snapshot().bytes_read > 0 and reader.cpu_s > 0.0
    finally:
        store.close()


def test_prerouted_waits_for_a_head_at_every_layer_but_the_last(tiny):
    shape, pack = tiny
    trace = map_trace(synthetic_trace(decode=8), shape)
    prof = load_profile("m4-pro-24gb")
    base = Compute(lambda t: 1e-3, lambda n, e: 0.0, 0.0, 0.0, "test")
    heads = base.with_heads(5e-4, 0.0)
    cfg = TwinConfig(budget="100%", mode="prerouted", io="buffered", stretch=1.0,
                     dilate_python=False)
    plain, with_heads = (run_twin(pack, trace, c, prof, cfg) for c in (base, heads))
    # 3 layers: heads run at the first two (the last has no next layer to predict)
    assert with_heads.compute_ms_per_token - plain.compute_ms_per_token == \
        pytest.approx(2 * 0.5, rel=1e-6)
    # the profile's heads: a 256-wide MLP over [hidden, routing now and before]
    a3b = SHAPES["qwen3-30b-a3b"]
    assert a3b.prerouter_head_params == (2048 + 2 * 128) * 256 + 256 * 128
    assert Compute.from_profile(prof, a3b).heads_s(1) == pytest.approx(
        4 * a3b.prerouter_head_params / (prof.value("int4_gbps") * 1e9))


def test_a_long_prompt_prefills_in_chunks_and_each_chunk_reads_its_experts(tiny):
    import sys
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_twin import long_prompt
    shape, pack = tiny
    traces = [synthetic_trace(decode=8), synthetic_trace(seed=1)]
    trace = long_prompt(traces, 100, 40)
    assert trace["calls"].tolist() == [40, 40, 20, 1]
    assert len(trace["routed"]) == 101 and trace["decode"].sum() == 1
    prof = load_profile("m4-pro-24gb")

    def loads(chunk, budget):
        mapped = map_trace(long_prompt(traces, 100, chunk), shape)
        r = run_twin(pack, mapped, zero_compute(), prof,
                     TwinConfig(budget=budget, io="buffered", stretch=1.0))
        return r.total_bytes // pack.layers[0].expert_bytes, mapped

    everything, mapped = loads(40, "100%")  # each needed expert read once, ever
    assert everything == sum(len(np.unique(mapped["routed"][:, l])) for l in range(3))
    assert loads(40, "25%")[0] > loads(100, "25%")[0]  # a small pool: again in each chunk


def test_the_twin_decides_by_its_rules():
    from edgemoe.whatif.twin.decide import decide_prefill_step, decide_readers, decide_routing
    rows = [{"profile": "p", "mode": "native", "budget": b, "readers": n,
             "forecast_decode_tok_s": tps}
            for b, n, tps in (("10%", 1, 5.0), ("10%", 2, 6.0), ("10%", 4, 6.1),
                              ("25%", 1, 9.0), ("25%", 2, 9.9), ("25%", 4, 10.0))]
    assert decide_readers(rows, "p") == 2  # 4 gains under 3%
    rows += [{"profile": "p", "mode": "advisory", "budget": b, "readers": 2,
              "forecast_decode_tok_s": tps} for b, tps in (("10%", 6.3), ("25%", 10.0))]
    assert decide_routing(rows, "p", 2) == "native"  # +5% and +1%: not at every budget
    rows[-1]["forecast_decode_tok_s"] = 10.5
    assert decide_routing(rows, "p", 2) == "advisory"  # +5% and +6%
    assert decide_prefill_step({512: 4.0, 1024: 2.0, 2048: 1.01, 4096: 1.0}) == 2048


def test_each_machine_default_is_what_the_twin_decided():
    """edgemoe.machines (what the code uses) against edgemoe.whatif.twin.decide over the twin's
    rows (tests/data/twin_defaults.json) and the TTFT limits, profile by profile."""
    from edgemoe.machines import machine_defaults
    from edgemoe.whatif.twin.decide import decide
    rows = json.loads((ROOT / "tests" / "data" / "twin_defaults.json").read_text())["rows"]
    profiles = sorted({r["profile"] for r in rows})
    assert len(profiles) >= 3
    for profile in profiles:
        d = machine_defaults(profile)
        assert decide(rows, profile) == {"readers": d.readers, "routing": d.routing,
                                         "prefill_step_size": d.prefill_step_size}, profile


def test_the_docs_defaults_table_is_the_code():
    """docs/mac.md's "Defaults per machine" table names every profile, each row as
    edgemoe.machines has it."""
    from edgemoe.machines import DEFAULTS
    text = (ROOT / "docs" / "mac.md").read_text()
    section = text.split("## Defaults per machine", 1)[1].split("\n## ", 1)[0]
    table = [line.strip("|").split("|") for line in section.splitlines()
             if line.startswith("| `")]
    seen = {}
    for cells in table:
        name, io, readers, policy, routing, step = (c.strip().strip("`") for c in cells[:6])
        seen[name] = (io, int(readers), policy, routing, int(step))
    shipped = all_profiles(contributed=ROOT / "no-contributed-profiles")  # measured ones need no row
    assert set(seen) == set(DEFAULTS) and set(shipped) <= set(seen)
    for name, d in DEFAULTS.items():
        assert seen[name] == (d.io, d.readers, d.cache_policy, d.routing,
                              d.prefill_step_size), name


def test_stream_options_take_this_machines_defaults(monkeypatch):
    from edgemoe.machines import machine_defaults
    from edgemoe.options import StreamOptions
    for name in ("m4-pro-24gb", "generic"):
        monkeypatch.setenv("EDGEMOE_MACHINE", name)
        d, o = machine_defaults(name), StreamOptions()
        assert (o.io, o.readers, o.cache_policy, str(o.routing)) == \
            (d.io, d.readers, d.cache_policy, d.routing)
        assert StreamOptions(io="buffered").io == "buffered"  # a choice still overrides
    monkeypatch.setenv("EDGEMOE_MACHINE", "m9-ultra")
    with pytest.raises(ValueError, match="EDGEMOE_MACHINE=m9-ultra: choose one of generic"):
        StreamOptions()


def test_a_mac_is_named_by_its_chip_and_memory(monkeypatch, caplog):
    import platform
    import subprocess
    from edgemoe import machines
    monkeypatch.delenv("EDGEMOE_MACHINE", raising=False)
    answers = {"machdep.cpu.brand_string": "Apple M4 Pro\n", "hw.memsize": f"{24 * 2**30}\n"}
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 0, stdout=answers[cmd[-1]]))
    assert machines.this_machine() == "m4-pro-24gb"
    # a plain M4 says neither Air nor mini: the profile of its chip and memory holds
    for memory, profile in ((24, "m4-air-24gb"), (16, "m4-mini-16gb"), (32, "m4-air-32gb")):
        answers.update({"machdep.cpu.brand_string": "Apple M4\n",
                        "hw.memsize": f"{memory * 2**30}\n"})
        assert machines.this_machine() == profile
    answers.update({"machdep.cpu.brand_string": "Apple M4 Pro\n",
                    "hw.memsize": f"{36 * 2**30}\n"})  # an M4 Pro no profile describes
    with caplog.at_level("WARNING", logger="edgemoe"):
        assert machines.this_machine() == "apple-silicon"
    assert "this Mac (m4-pro-36gb) matches no shipped machine profile" in caplog.text
    assert "--measure-machine" in caplog.text
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    assert machines.this_machine() == "generic"
