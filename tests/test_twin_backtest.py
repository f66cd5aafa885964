"""The back-test (scripts/bench_twin.py --backtest, edgemoe.whatif.twin.backtest): each peer's
design forecast on its profile, short (one trace, 24 decoded tokens), and the host sync as
the model says: a synced layer costs the read and the GPU's idle."""

import json
from pathlib import Path

import pytest

from edgemoe.whatif.twin import backtest as bt
from edgemoe.whatif.twin.profiles import all_profiles, load_profile

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "edgemoe" / "models" / "fine" / "traces" / "stdlib.npz"


def bench_twin():
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_twin", ROOT / "scripts" / "bench_twin.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_backtest_writes_every_row_with_its_error_and_sensitivity(tmp_path):
    out = tmp_path / "bt.json"
    bench_twin().main(["--backtest", "--peers", "streamlx", "--trace", str(TRACE),
                       "--max-decode", "24", "--json", str(out)])
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [r["published"] for r in rows] == [15.9, 7.6, 7.2, 33.3]
    for r in rows:
        assert r["error"] == pytest.approx(r["tok_s"] / r["published"] - 1)
        assert r["token_ms"] == pytest.approx(r["compute_ms"] + r["sync_ms"] + r["copy_ms"]
                                              + r["read_ms"] - r["hidden_ms"])
        assert set(r["sensitivity_tok_s"]) >= {"host_sync_us", "sync_idle_us"}
    resident = rows[-1]
    assert resident["misses_per_token"] == 0 and resident["read_ms"] == 0
    # a smaller budget misses more and forecasts slower
    assert rows[0]["miss_rate"] < rows[1]["miss_rate"] < rows[2]["miss_rate"]
    assert rows[0]["tok_s"] > rows[2]["tok_s"]


def test_a_synced_layer_costs_the_read_and_the_idle_a_queue_full_design_does_not():
    design = next(d for d in bt.DESIGNS if d.peer == "streamlx")
    profile = load_profile(design.profile)
    one = bt.token_ms(design, profile, 0.0, 0.0)
    none = bt.token_ms(bt.replace(design, syncs_per_layer=0), profile, 0.0, 0.0)
    two = bt.token_ms(bt.replace(design, syncs_per_layer=2), profile, 0.0, 0.0)
    layers = bt.peer_shape(design.shape).layers
    read, idle = profile.value("host_sync_us") / 1e3, profile.value("sync_idle_us") / 1e3
    assert one["sync_ms"] - none["sync_ms"] == pytest.approx(layers * (read + idle))
    assert two["sync_ms"] - one["sync_ms"] == pytest.approx(layers * read)
    # the figures are BigRig's, cited, with the range the sensitivity column runs
    for name, p in all_profiles().items():
        for fig in ("host_sync_us", "sync_idle_us"):
            assert "BigRig" in p.figures[fig]["source"] and "range" in p.figures[fig], name


def test_every_design_names_a_profile_and_a_source():
    names = set(all_profiles())
    for d in bt.DESIGNS:
        assert d.profile in names and d.source and d.published > 0
        bt.peer_shape(d.shape)


def test_the_defaults_hold_under_the_host_sync_model():
    """The twin's rows re-forecast with the host-sync model (and the M4's kernel rate) decide
    the same defaults as edgemoe.machines pins (docs/mac.md, "Defaults per machine"), on
    today's decode path (a sync a streamed layer, prerouted one a token) and on the path
    before it (two a layer, prerouted one); on the latter every row got slower by the syncs
    it pays, and today's prerouted rows are faster than the latter's."""
    from edgemoe.machines import machine_defaults
    from edgemoe.whatif.twin.decide import decide, with_sync_model
    rows = json.loads((ROOT / "tests" / "data" / "twin_defaults.json").read_text())["rows"]
    today, before = with_sync_model(rows), with_sync_model(rows, syncs_per_layer=(2, 1))
    for new in (today, before):
        for profile in sorted({r["profile"] for r in rows}):
            d = machine_defaults(profile)
            assert decide(new, profile) == {"readers": d.readers, "routing": d.routing,
                                            "prefill_step_size": d.prefill_step_size}, profile
    for old, then, now in zip(rows, before, today):
        if old["profile"] != "m4-air-24gb":  # its int4 rate rose (BigRig's kernels)
            assert then["forecast_decode_tok_s"] < old["forecast_decode_tok_s"]
        assert now["forecast_decode_tok_s"] > then["forecast_decode_tok_s"]


def test_a_compute_wait_makes_up_the_cpu_a_reader_took_meanwhile():
    """--validate's twin (compute on this CPU): CPU seconds the reader spent during a
    compute wait extend it; a wait with no reader work is as asked."""
    import time
    from edgemoe.whatif.twin.compute import Waiter
    cpu = {"s": 0.0}

    def reader_cpu():  # 10 ms of reader CPU appear during each wait
        cpu["s"] += 0.005
        return cpu["s"]

    w = Waiter(1.0, contending=reader_cpu)
    tic = time.perf_counter()
    w.wait(0.01)
    took = time.perf_counter() - tic
    assert w.contended == pytest.approx(0.005) and took >= 0.015
    plain = Waiter(1.0)
    plain.wait(0.01)
    assert plain.contended == 0.0 and plain.compute == pytest.approx(0.01)
