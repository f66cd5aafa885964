"""edgemoe.doctor: a pack's sizes and fit from its manifest, and a predicted decode rate."""

import json
import re

import numpy as np
import pytest

from edgemoe import calibrate, doctor
from edgemoe.streaming.cache import DEFAULT_POLICY
from edgemoe.format.pack import Pack
from edgemoe.format.families import kv_bytes_per_token
from edgemoe.mlx_backend.families import model_args
from edgemoe.streaming.budget import HEADROOM, RUNTIME_BYTES, fitting_budget, minimum_bytes


@pytest.fixture(scope="module")
def pack(packs):
    return Pack.open(packs["qwen3_moe_large"]["hf"])


def test_doctor_prints_the_packs_figures(pack, capsys, tmp_path):
    routed = np.random.default_rng(0).integers(0, 32, (40, 4, 2)).astype(np.int32)
    routed[:, :, 1] = (routed[:, :, 0] + 1) % 32  # distinct top-2
    trace = tmp_path / "t.npz"
    np.savez(trace, routed=routed, decode=np.arange(40) >= 8, layers=np.arange(4),
             expert_bytes=np.array([l.expert_bytes for l in pack.layers]))
    config = json.loads((pack.path / "config.json").read_text())
    fixed = pack.resident_bytes + RUNTIME_BYTES + 4096 * kv_bytes_per_token(config)
    memory = (fixed + pack.expert_bytes / 2) / (1 - HEADROOM) / 1e9  # GB: room for half
    doctor.main(["--model", str(pack.path), "--memory", str(memory), "--trace", str(trace)])
    out = capsys.readouterr().out
    minimum = minimum_bytes(pack)
    lines = {l.strip().split("  ")[0]: l for l in out.splitlines()}
    assert doctor.fmt_bytes(minimum) in lines["minimum budget"]
    assert doctor.fmt_bytes(pack.resident_bytes) in lines["resident"]
    assert doctor.fmt_bytes(pack.expert_bytes) in lines["routed experts"]
    assert doctor.fmt_bytes(pack.resident_bytes + pack.expert_bytes) in lines["total"]
    assert re.search(r"disk .* [0-9.]+ GB/s from disk .* records cached\)", out), out
    assert re.search(r"one expert [0-9.]+ ms .* resident [0-9.]+ ms/token", out), out
    assert f"{DEFAULT_POLICY} replay of {trace}" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[-8:]}
    assert rows["25%"][1] == "8" and rows["100%"][1] == "32"  # slots per layer
    assert float(rows["25%"][-2]) < float(rows["100%"][-2])  # more misses, slower
    budget = int(re.search(r"--expert-budget auto gives (\d+) bytes", out).group(1))
    assert minimum <= budget < pack.expert_bytes
    as_load = fitting_budget(pack, config, int(memory * 1e9), model_args=model_args(config))
    assert budget == as_load  # as the MLX backend's load() sizes it


def test_doctor_says_when_it_does_not_fit(pack, capsys):
    doctor.main(["--model", str(pack.path), "--memory", "1MB"])
    out = capsys.readouterr().out
    assert "the model does not fit in 1.0 MB of available memory" in out
    assert "assumed slots / experts" in out  # no trace: the assumption is stated


def test_prediction_adds_compute_and_reads(pack):
    k, per_token = pack.top_k, sum(l.expert_bytes for l in pack.layers)
    p = doctor.predict(pack, 5e-3, disk_rate=per_token * k / 4e-3, hit_rate=0.5,
                       overhead_s=1e-4)
    assert p.compute_s == pytest.approx(5e-3 + 1e-4 * len(pack.layers))
    assert p.read_s == pytest.approx(2e-3)
    assert p.serial_tps == pytest.approx(1 / (p.compute_s + 2e-3))
    assert p.overlapped_tps == pytest.approx(1 / p.compute_s)
    assert doctor.predict(pack, 5e-3, 1e9, 1.0).read_s == 0


def test_resident_step_calibration_times_the_real_model_class(pack):
    per_layer, outside = calibrate.decoder_layer_seconds(pack, steps=3)
    # the per-layer share is a difference of two medians: noise may make it 0, never less
    assert per_layer >= 0 and outside >= 0 and per_layer + outside > 0


def test_doctor_errors_are_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit, match="edgemoe.doctor: error: .*not an edgemoe pack"):
        doctor.main(["--model", str(tmp_path)])
