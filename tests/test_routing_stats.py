"""scripts/routing_stats.py: the routing statistics of a trace, on routings whose figures are known."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from routing_stats import layer_stats, trace_stats  # noqa: E402


def test_a_round_robin_routing_is_uniform_and_never_reused():
    E, k, T = 16, 2, 64
    ids = np.array([[(t * k + j) % E for j in range(k)] for t in range(T)])
    s = layer_stats([ids], E)
    assert s["busiest"] == pytest.approx(1 / E)
    assert s["cover90"] == pytest.approx(15 / 16)  # 0.9 x 16 = 14.4 -> 15 experts
    assert s["overlap"] == 0 and s["reuse@4"] == 0
    assert s["reuse@16"] == 1  # the 8 tokens before cover all 16 experts
    assert s["union@2"] == 1 and s["union@8"] == 1


def test_one_set_repeated_is_fully_reused():
    ids = np.tile([3, 5], (20, 1))
    s = layer_stats([ids], 8)
    assert s["busiest"] == 0.5 and s["cover90"] == 2 / 8
    assert s["overlap"] == 1 and s["reuse@16"] == 1
    assert s["union@2"] == pytest.approx(1 / 2) and s["union@8"] == pytest.approx(1 / 8)


def test_overlap_and_windows_count_within_each_sequence_only():
    # within each sequence: {0,1} then {1,2}: one of two experts shared; across the two
    # sequences nothing is compared
    a = np.array([[0, 1], [1, 2]])
    b = np.array([[5, 6], [6, 7]])
    s = layer_stats([a, b], 8)
    assert s["overlap"] == 0.5
    assert s["union@2"] == pytest.approx(3 / 4)
    assert s["busiest"] == pytest.approx(2 / 8)


def test_a_report_checks_the_targets_on_the_worst_layer():
    T, k = 50, 2
    rng = np.random.default_rng(0)
    spread = rng.integers(0, 32, (T, 1, k))  # near uniform
    skewed = np.zeros((T, 1, k), dtype=int)
    skewed[:, 0, 1] = rng.integers(1, 32, T)  # expert 0 in every token: half the selections
    trace = {"layers": np.array([0, 1]), "num_experts": np.array([32, 32]),
             "routed": np.concatenate([spread, skewed], axis=1)}
    report = trace_stats([trace])
    assert report["worst"]["busiest"] == 0.5
    assert report["within_targets"]["busiest"] is False
    assert report["per_layer"][0]["busiest"] < 0.2
