"""The bundled MoE, the fine-grained reference (128 experts, top-8): the default of load()
and of the generate CLI."""

import subprocess
import sys

import edgemoe
from edgemoe.format.source import BUNDLED_MODEL as DEFAULT_MODEL
from edgemoe.format.pack import Pack


def test_bundled_pack_is_whole_and_small():
    pack = Pack.open(DEFAULT_MODEL)
    assert pack.model_type == "qwen3_moe" and len(pack.layers) == 8 and pack.top_k == 8
    assert all(l.num_experts == 128 for l in pack.layers)
    assert pack.expert_bytes > 0.9 * (pack.expert_bytes + pack.resident_bytes)  # 93%
    shipped = [f for f in DEFAULT_MODEL.rglob("*")  # less what a load writes beside them
               if f.is_file() and not f.name.startswith("expert_deltas.")]
    # 36.6 MB pack (its card), 4.5 MB next-token heads (and their own adapter, the pack's on
    # layers 5-7: 3.0 MB), 4.6 MB same-token heads, 8.1 MB adapter
    assert sum(f.stat().st_size for f in shipped) < 60e6


def test_load_without_a_path_gives_the_bundled_model():
    model, tokenizer = edgemoe.load(expert_budget=0.25)
    assert model.expert_store.info().path == DEFAULT_MODEL
    text = edgemoe.generate(model, tokenizer, "import os\n", max_tokens=12)
    assert len(text) > 0


def test_generate_cli_defaults_to_the_bundled_model():
    out = subprocess.run([sys.executable, "-m", "edgemoe.generate", "--prompt", "def ",
                          "--ignore-chat-template", "--max-tokens", "8"],
                         capture_output=True, text=True, check=True).stdout
    assert "Generation: " in out


DRAFT = DEFAULT_MODEL.parent / "fine-draft"


def test_shipped_prerouter_heads_serve_the_bundled_model():
    """With no --prerouter, the prerouted modes use the heads the bundled pack carries, as
    their config routes: the layers it predicts read a token ahead (cache-conditional: the
    router chooses among the simulated slots and the prediction, so an expert the store's
    slots do not hold is read on demand now and then), the others keep their router."""
    from edgemoe.routing.heads_config import read_config

    predicted = read_config(DEFAULT_MODEL / "prerouter").predicted_layers
    model, tokenizer = edgemoe.load(expert_budget=0.25, routing="prerouted")
    store = model.expert_store
    counts = []
    for _ in edgemoe.stream_generate(model, tokenizer, "def read_lines(path):", max_tokens=16):
        counts.append(store.on_demand_by_layer())
    first, last = counts[0], counts[-1]  # after the prompt, after 16 tokens
    waits = {layer: last[layer] - first[layer] for layer in first}
    kept = [layer for layer in waits if layer not in predicted]
    mean = lambda layers: sum(waits[l] for l in layers) / len(layers)
    # (on 31 tokens of rich's sources: 6-10 a conditional layer, against 37-56)
    assert predicted and mean(predicted) < mean(kept) / 3, waits
    assert store.snapshot().prefetches > 0


def test_shipped_same_token_heads_route_nearly_as_the_router_does():
    """PACK/prerouter-same-token, the near-exact prerouted option: the heads choose the
    experts (the logits move), and the next token stays native's on most of a held-out-like
    text (92% top-1 agreement on the card's 16,384 tokens)."""
    import sysconfig
    from pathlib import Path

    import mlx.core as mx

    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    logits = []
    for options in ({}, {"routing": "prerouted",
                         "prerouter_path": DEFAULT_MODEL / "prerouter-same-token"}):
        model, tokenizer = edgemoe.load(expert_budget=1.0, **options)
        logits.append(model(mx.array(tokenizer.encode(text)[:256])[None]))
    native, same_token = logits
    assert not mx.array_equal(native, same_token)
    agree = (native.argmax(-1) == same_token.argmax(-1)).mean().item()
    assert agree > 0.8, agree


def test_shipped_lora_serves_the_prerouted_bundled_model_unmerged():
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from edgemoe.mlx_backend.lora import lora_layers

    tokens = mx.array([[3, 17, 250, 4000, 12, 99]])
    outputs = []
    for adapter in ("none", "pack"):  # "pack": the adapter the bundled pack carries
        model, _ = edgemoe.load(routing="prerouted", prerouter_path="pack", adapter_path=adapter)
        outputs.append(model(tokens))
    assert len(lora_layers(model)) == 4 * len(model.layers)  # attention, unmerged
    assert not mx.allclose(outputs[0], outputs[1])
    # the routed experts' deltas stream with them: in every slot, never parameters
    assert all(slots.layer.delta_bytes > 0 for slots in model.expert_store.layers.values())
    assert not any(".switch_mlp." in name for name, _ in tree_flatten(model.parameters()))


def test_documented_merge_figures_are_the_shipped_reports():
    import json
    import re
    from pathlib import Path

    docs = Path(__file__).resolve().parents[1] / "docs" / "adapters.md"
    readme = " ".join(docs.read_text().split())
    found = re.search(r"(\d+)% of the delta survives at the median projection, (\d+)% at the "
                      r"logits, and the merged model keeps (\d+)% of the KL gain", readme)
    assert found, "docs/adapters.md no longer states the merge figures"
    report = json.loads((DEFAULT_MODEL / "adapter" / "report.json").read_text())
    merged = report["merged"]
    gain = report["before"]["kl_to_teacher"] - report["after"]["kl_to_teacher"]
    kept = (report["before"]["kl_to_teacher"] - merged["quality"]["kl_to_teacher"]) / gain
    expected = [merged["projection_survival_median"], merged["logit_survival"], kept]
    assert [int(g) for g in found.groups()] == [round(100 * v) for v in expected]


def test_the_model_card_states_what_the_pack_carries():
    """The card's section on the heads, adapter and cache policy is their reports' (as
    `scripts/model_card.py --assets` writes it)."""
    import importlib.util
    import json
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "model_card.py"
    spec = importlib.util.spec_from_file_location("model_card", script)
    card = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(card)
    section = card.assets_section(DEFAULT_MODEL)
    report = json.loads((DEFAULT_MODEL / "prerouter" / "report.json").read_text())
    recall = {r["target"]: r["head"]["recall"] for r in report["layers"]}
    assert f"| 5 | 4 | {100 * recall[5]:.1f}% |" in section
    assert "the attention and every routed expert" in section
    assert section in (DEFAULT_MODEL / "README.md").read_text()


def test_the_bundled_model_routes_as_todays_moes_do():
    """Its card carries the routing statistics of its held-out text, within the targets of a
    realistic reference (scripts/routing_stats.py: busiest expert <= 10% and 90% of selections
    needing >= 35% of the experts in every layer, next-token overlap 0.2-0.5)."""
    import json

    report = json.loads((DEFAULT_MODEL / "routing_stats.json").read_text())
    assert report["num_experts"] == [128] * 8 and report["tokens"] >= 4096
    assert all(report["within_targets"].values()), report["within_targets"]
    assert "### Routing statistics" in (DEFAULT_MODEL / "README.md").read_text()
    # its draft's tokenizer is its own: drafted tokens are the MoE's
    assert (DRAFT / "tokenizer.json").read_bytes() == (DEFAULT_MODEL / "tokenizer.json").read_bytes()


def test_a_whole_layer_of_fine_grained_experts_reads_at_once():
    """At a full budget a long prompt needs every expert of a layer: one merged read of
    128 records would pass preadv's buffer limit (EINVAL) if the reader did not cut it."""
    import sysconfig
    from pathlib import Path

    import mlx.core as mx

    model, tokenizer = edgemoe.load(expert_budget=1.0)
    text = (Path(sysconfig.get_paths()["stdlib"]) / "json" / "decoder.py").read_text()
    mx.eval(model(mx.array(tokenizer.encode(text)[:512])[None]))
    store = model.expert_store  # nearly every expert of every layer, read without error
    assert store.snapshot().bytes_read > 0.9 * store.info().expert_bytes
