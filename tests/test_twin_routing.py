"""Generated routing (edgemoe.whatif.twin.routing_gen): a 256-expert, 40-layer shape uses all of its
experts in distinct layers, and routing generated from three of the bundled model's traces
caches like the fourth, held out."""

from pathlib import Path

import numpy as np
import pytest

from edgemoe.streaming.trace import load_trace
from edgemoe.whatif.twin.routing_gen import fit, generate, hit_rates, shape_routing
from edgemoe.whatif.twin.shapes import SHAPES, map_trace

TRACES = Path(__file__).resolve().parents[1] / "edgemoe" / "models" / "fine" / "traces"


@pytest.fixture(scope="module")
def traces():
    return {f.stem: load_trace(f) for f in sorted(TRACES.glob("*.npz"))}


def test_a_256_expert_shape_uses_every_expert_in_distinct_layers(traces):
    shape = SHAPES["qwen3.5-35b-a3b"]
    relabelled = map_trace(traces["stdlib"], shape)
    # the old map: each layer uses half of its experts
    assert max(len(np.unique(relabelled["routed"][:, l])) for l in range(40)) <= 128
    generated = shape_routing(shape, [traces["stdlib"]])[0]
    routed = generated["routed"]
    assert routed.shape[1:] == (40, 8)
    assert min(len(np.unique(routed[:, l])) for l in range(40)) > 160  # more than the old map could
    assert len(np.unique(routed)) == 256
    assert all(len(np.unique(r)) == 8 for r in routed[:, 0])  # top-k distinct per token
    # no two layers route alike (map_trace's layer l and l + 8 were the same routing)
    firsts = {tuple(routed[:, l].reshape(-1)[:64]) for l in range(40)}
    assert len(firsts) == 40
    assert (generated["expert_bytes"] == shape.record_bytes).all()


def test_generated_routing_caches_like_a_held_out_trace(traces):
    held = traces["docs"]
    stats = fit([t for name, t in traces.items() if name != "docs"])
    gen = generate(stats, held, 128, 8, 8, seed=0)
    real = hit_rates(held, ("25%",))
    synth = hit_rates(gen, ("25%",))
    for key in real:  # docs/mac.md: all four held out, mean within 2 points
        assert abs(synth[key] - real[key]) < 0.04, (key, real[key], synth[key])
    # and the fitted overlap is what the generated layer shows
    for l, s in enumerate(stats):
        r = gen["routed"][gen["decode"].astype(bool), l]
        same = np.mean([len(np.intersect1d(a, b)) for a, b in zip(r[1:], r[:-1])]) / 8
        assert abs(same - s.overlap) < 0.08
