"""`--expert-budget auto` (the default): the experts that fit in the memory available,
beside the resident weights, a KV cache and the runtime; refused before loading when even
the minimum does not fit; `doctor` prints the same figure."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import edgemoe
from edgemoe import constrained
from edgemoe.format.families import kv_bytes_per_token
from edgemoe.format.source import open_source
from edgemoe.streaming import telemetry
from edgemoe.streaming.budget import (AUTO_KV_TOKENS, HEADROOM, RUNTIME_BYTES, SlotPlan,
                                      fitting_budget)

from conftest import error_line, tool_module

ROOT = Path(__file__).resolve().parents[1]
FAMILY = "qwen3_moe"
generate, doctor = tool_module("generate"), tool_module("doctor")


def memory_for(pack, config, expert_bytes: int) -> int:
    """The available memory at which auto gives `expert_bytes`."""
    tokens = min(AUTO_KV_TOKENS, config["max_position_embeddings"])
    need = pack.resident_bytes + tokens * kv_bytes_per_token(config) + RUNTIME_BYTES
    return int((need + expert_bytes) / (1 - HEADROOM)) + 1


@pytest.fixture
def pack_and_config(packs):
    path = packs[FAMILY]["hf"]
    return path, open_source(path), json.loads((path / "config.json").read_text())


def test_auto_holds_every_expert_when_the_model_fits(pack_and_config):
    path, pack, _ = pack_and_config
    model, _ = edgemoe.load(path)  # the default budget is auto
    assert model.expert_store.slots_per_layer == pack.layers[0].num_experts


def test_auto_sizes_the_slots_from_the_memory_available(pack_and_config, monkeypatch,
                                                         capsys):
    path, pack, config = pack_and_config
    plan = SlotPlan.of(pack)
    half = plan.total_bytes // 2
    monkeypatch.setattr(telemetry, "available_memory_bytes",
                        lambda: memory_for(pack, config, half))
    model, _ = edgemoe.load(path, expert_budget="auto")
    store = model.expert_store
    assert abs(store.budget_bytes - half) <= 2  # rounding of the memory figure
    assert store.slots_per_layer == plan.slots_for_bytes(store.budget_bytes) < \
        pack.layers[0].num_experts
    assert "--expert-budget auto:" in capsys.readouterr().err


def test_a_model_that_cannot_fit_is_refused_before_loading(pack_and_config, monkeypatch):
    path, pack, config = pack_and_config
    too_little = memory_for(pack, config, SlotPlan.of(pack).minimum_bytes) - 10**6
    monkeypatch.setattr(telemetry, "available_memory_bytes", lambda: too_little)
    message = error_line(generate.main, "--model", path)
    assert "the model does not fit in" in message and "minimum expert budget" in message
    assert "resident weights" in message and "KV cache" in message


def test_doctor_prints_the_budget_auto_gives(pack_and_config, capsys):
    path, pack, config = pack_and_config
    memory = memory_for(pack, config, SlotPlan.of(pack).total_bytes // 3)
    doctor.main(["--model", str(path), "--memory", f"{memory}B"])
    expected = fitting_budget(pack, config, memory)
    assert f"--expert-budget auto gives {expected} bytes" in capsys.readouterr().out


@pytest.mark.skipif(constrained.why_unavailable() is not None,
                    reason=f"no cgroups here: {constrained.why_unavailable()}")
def test_available_memory_follows_a_memory_cgroup():
    code = "from edgemoe.streaming.telemetry import available_memory_bytes as a; print(a())"
    r = subprocess.run(constrained.command("--memory", "1G") + [sys.executable, "-c", code],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert 0.5 * 2**30 < int(r.stdout) <= 2**30
