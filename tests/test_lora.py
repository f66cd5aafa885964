"""The recovery LoRA: an unmerged delta beside the int4 matmuls, in mlx-lm's format."""

import json
import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.tuner.utils import linear_to_lora_layers
from mlx_lm.utils import load as mlx_lm_load

import edgemoe
from edgemoe import train_lora
from edgemoe.format.pack import PackError
from edgemoe.format.source import open_source
from edgemoe.mlx_backend.lora import apply_lora, default_targets, lora_layers, save_adapter, survival
from edgemoe.mlx_backend.gates import moe_blocks
from edgemoe.mlx_backend.prerouter import Prerouter, config_for_model, load_prerouter, save_prerouter

TOKENS = mx.array(np.random.default_rng(2).integers(3, 500, (1, 12)))


def randomize_deltas(model, seed=0):
    """Non-zero A and B, as after training."""
    rng = np.random.default_rng(seed)
    model.update(tree_unflatten([
        (k, mx.array(rng.normal(0, 0.05, v.shape).astype(np.float32)))
        for k, v in tree_flatten(model.trainable_parameters())]))


def random_heads(model, folder):
    """Untrained prerouter heads for `model` (seeded), saved to `folder`."""
    mx.random.seed(0)
    save_prerouter(Prerouter(config_for_model(
        "qwen3_moe", model.args.hidden_size, moe_blocks(model))), folder)


def test_unmerged_layer_is_the_explicit_formula(packs):
    model, _ = edgemoe.load(packs["qwen3_moe"]["hf"])
    apply_lora(model, rank=4, scale=2.0)
    randomize_deltas(model)
    layer = model.layers[1].self_attn.q_proj
    base = layer.linear
    assert isinstance(base, nn.QuantizedLinear)
    x = mx.array(np.random.default_rng(1).standard_normal((1, 3, 64)).astype(np.float32))
    expected = mx.quantized_matmul(x, base.weight, base.scales, base.biases, transpose=True,
                                   group_size=base.group_size, bits=base.bits)
    expected = expected + (2.0 * ((x @ layer.lora_a) @ layer.lora_b)).astype(x.dtype)
    assert mx.array_equal(layer(x), expected)


def test_targets_leave_the_routers_alone(packs):
    for family in ("qwen3_moe", "deepseek_v3"):
        model, _ = edgemoe.load(packs[family]["hf"])
        keys = default_targets(model)
        assert keys and not any(k.endswith("gate") for k in keys)
        assert "self_attn.o_proj" in keys
    assert any("shared_experts" in k for k in keys)  # DeepSeek's shared experts


def test_targets_leave_a_prerouted_router_alone(packs, tmp_path):
    """In prerouted modes the router sits inside a RouterTap (`gate.native`)."""
    path = packs["qwen3_moe"]["hf"]
    model, _ = edgemoe.load(path)
    random_heads(model, tmp_path / "heads")
    model, _ = edgemoe.load(path, routing="prerouted", prerouter_path=tmp_path / "heads")
    keys = default_targets(model)
    assert keys and not any("gate" in k.split(".") for k in keys)


def test_zero_initialised_adapter_leaves_logits_bit_identical(packs):
    model, _ = edgemoe.load(packs["olmoe"]["hf"])
    before = model(TOKENS)
    apply_lora(model)
    assert mx.array_equal(model(TOKENS), before)


def test_adapter_round_trip_through_load(packs, tmp_path):
    path = packs["qwen3_moe"]["hf"]
    model, _ = edgemoe.load(path)
    config = apply_lora(model, rank=4)
    randomize_deltas(model, seed=3)
    expected = model(TOKENS)
    save_adapter(model, config, tmp_path / "adapter")
    loaded, _ = edgemoe.load(path, adapter_path=tmp_path / "adapter")
    assert mx.array_equal(loaded(TOKENS), expected)
    assert not mx.array_equal(expected, edgemoe.load(path)[0](TOKENS))


def test_an_adapter_in_mlx_lm_lora_format_loads(packs, tmp_path):
    """Written as mlx_lm.lora writes it: adapter_config.json of its arguments,
    adapters.safetensors of the trainable parameters."""
    path = packs["mixtral"]["hf"]
    model, _ = edgemoe.load(path)
    model.freeze()
    lora_parameters = {"rank": 8, "dropout": 0.0, "scale": 10.0,
                       "keys": ["self_attn.q_proj", "self_attn.v_proj"]}
    linear_to_lora_layers(model, 2, lora_parameters)
    randomize_deltas(model, seed=4)
    out = tmp_path / "mlx_lm_adapter"
    out.mkdir()
    mx.save_safetensors(str(out / "adapters.safetensors"),
                        dict(tree_flatten(model.trainable_parameters())))
    (out / "adapter_config.json").write_text(json.dumps({
        "fine_tune_type": "lora", "num_layers": 2, "lora_parameters": lora_parameters,
        "model": str(path), "iters": 100, "batch_size": 4, "learning_rate": 1e-5}))
    loaded, _ = edgemoe.load(path, adapter_path=out)
    assert mx.array_equal(loaded(TOKENS), model(TOKENS))


# ---------------------------------------------------------------- distillation
TEXT = "\n\n".join((Path(json.__file__).parent / f).read_text()
                   for f in ("decoder.py", "encoder.py", "scanner.py"))


def distil(tmp_path, checkpoints, packs, out, *extra, teacher=None):
    """train_lora on the tiny Qwen3-MoE: the int4 pack distilled from its fp32 source."""
    hf, _ = checkpoints["qwen3_moe"]
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    argv = ["--model", str(packs["qwen3_moe"]["hf"]), "--teacher", str(teacher or hf),
            "--data", str(data),
            "--out", str(out), "--context", "64", "--batch-size", "4", "--eval-tokens", "512",
            "--save-every", "5", *extra]
    train_lora.main(argv)
    return json.loads((out / "report.json").read_text())


def test_distillation_closes_part_of_the_gap_and_merging_loses_it(checkpoints, packs, tmp_path):
    report = distil(tmp_path, checkpoints, packs, tmp_path / "lora", "--routing", "native",
                    "--steps", "60", "--lr", "5e-5")
    before, after, merged = report["before"], report["after"], report["merged"]
    assert after["kl_to_teacher"] < 0.85 * before["kl_to_teacher"]
    assert after["top1_agreement"] > before["top1_agreement"]
    assert merged["quality"]["kl_to_teacher"] > after["kl_to_teacher"]
    assert 0 < merged["logit_survival"] < 0.9 and merged["projection_survival"] < 0.9
    # the adapter serves unmerged through load(), as the report measured it
    model, tokenizer = edgemoe.load(packs["qwen3_moe"]["hf"], adapter_path=tmp_path / "lora")
    assert len(lora_layers(model)) == len(report["lora"]["keys"]) * len(model.layers)


def test_an_interrupted_run_resumes_to_the_same_adapter(checkpoints, packs, tmp_path,
                                                        monkeypatch, capsys):
    steps = ("--routing", "native", "--steps", "10")
    distil(tmp_path, checkpoints, packs, tmp_path / "whole", *steps)
    save = train_lora.TrainState.save

    def interrupt_after_step_5(self, *args):
        save(self, *args)
        if self.step == 5:
            raise KeyboardInterrupt

    monkeypatch.setattr(train_lora.TrainState, "save", interrupt_after_step_5)
    with pytest.raises(SystemExit, match="edgemoe.train_lora: interrupted"):  # Ctrl-C
        distil(tmp_path, checkpoints, packs, tmp_path / "resumed", *steps)
    monkeypatch.undo()
    capsys.readouterr()
    saved_steps = []
    monkeypatch.setattr(train_lora.TrainState, "save",
                        lambda self, *args: (saved_steps.append(self.step), save(self, *args)))
    distil(tmp_path, checkpoints, packs, tmp_path / "resumed", *steps)
    # it went on from step 5 (a run from scratch, being seeded, would end the same)
    assert "step 5" in capsys.readouterr().out and saved_steps == [10]
    whole = mx.load(str(tmp_path / "whole" / "adapters.safetensors"))
    resumed = mx.load(str(tmp_path / "resumed" / "adapters.safetensors"))
    assert whole.keys() == resumed.keys()
    assert all(mx.array_equal(whole[k], resumed[k]) for k in whole)


def test_prerouted_student_keeps_its_heads_frozen(checkpoints, packs, tmp_path):
    model, _ = edgemoe.load(packs["qwen3_moe"]["hf"])
    random_heads(model, tmp_path / "heads")
    before = dict(tree_flatten(load_prerouter(tmp_path / "heads").parameters()))
    report = distil(tmp_path, checkpoints, packs, tmp_path / "lora",
                    "--prerouter", str(tmp_path / "heads"), "--steps", "4")
    assert report["routing"] == "prerouted"
    after = dict(tree_flatten(load_prerouter(tmp_path / "heads").parameters()))
    assert all(mx.array_equal(before[k], after[k]) for k in before)
    saved = mx.load(str(tmp_path / "lora" / "adapters.safetensors"))
    assert saved and all(k.endswith(("lora_a", "lora_b")) for k in saved)


def test_survival_is_the_projection_on_the_unmerged_effect(packs):
    effect = mx.array([[1.0, -2.0], [0.5, 3.0]])
    assert survival(effect, effect) == 1.0 and survival(-effect, effect) == -1.0
    assert survival(mx.zeros_like(effect), effect) == 0.0
    assert abs(survival(0.3 * effect + mx.array([[2.0, 1.0], [0.0, 0.0]]), effect) - 0.3) < 1e-6
    # a delta far above the quantization step survives merging almost whole
    x = mx.array(np.random.default_rng(5).standard_normal((1, 6, 64)).astype(np.float32))
    model, _ = edgemoe.load(packs["qwen3_moe"]["hf"])
    apply_lora(model, rank=4, scale=1.0)
    layer = model.layers[0].self_attn.o_proj
    layer.lora_b = mx.full(layer.lora_b.shape, 1.0)
    base = layer.linear(x)
    assert 0.95 < survival(layer.fuse()(x) - base, layer(x) - base) < 1.05


def test_a_pack_teaches_as_its_int4_native_routing(checkpoints, packs, tmp_path):
    """`--teacher PACK`: the pack itself, every expert resident, native routing. A native
    student starts at its teacher exactly; a prerouted one starts at the routing's gap."""
    pack = packs["qwen3_moe"]["hf"]
    report = distil(tmp_path, checkpoints, packs, tmp_path / "native", "--routing", "native",
                    "--steps", "1", teacher=pack)
    assert report["before"]["kl_to_teacher"] == 0.0
    assert report["before"]["perplexity"] == report["before"]["teacher_perplexity"]
    model, _ = edgemoe.load(pack)
    random_heads(model, tmp_path / "heads")
    report = distil(tmp_path, checkpoints, packs, tmp_path / "prerouted", "--steps", "1",
                    "--prerouter", str(tmp_path / "heads"), teacher=pack)
    assert report["before"]["kl_to_teacher"] > 0.0


# ---------------------------------------------------------------- the routed experts' deltas
EXPERTS = ["mlp.switch_mlp.gate_proj", "mlp.switch_mlp.up_proj", "mlp.switch_mlp.down_proj"]


def mlx_lm_expert_adapter(checkpoints, out, seed=5):
    """mlx-lm's own int4 model with a LoRA of an attention projection and of the routed
    experts (its LoRASwitchLinear), trained-like deltas, saved as mlx_lm.lora saves it."""
    model, _ = mlx_lm_load(str(checkpoints["qwen3_moe"][1]))
    model.freeze()
    params = {"rank": 4, "dropout": 0.0, "scale": 10.0, "keys": ["self_attn.q_proj", *EXPERTS]}
    linear_to_lora_layers(model, len(model.layers), params)
    randomize_deltas(model, seed)
    out.mkdir()
    mx.save_safetensors(str(out / "adapters.safetensors"),
                        dict(tree_flatten(model.trainable_parameters())))
    (out / "adapter_config.json").write_text(json.dumps({
        "fine_tune_type": "lora", "num_layers": len(model.layers), "lora_parameters": params}))
    return model


def test_the_experts_deltas_stream_with_them_as_mlx_lm_computes_them(checkpoints, packs,
                                                                     tmp_path):
    expected = mlx_lm_expert_adapter(checkpoints, tmp_path / "adapter")(TOKENS)
    path = packs["qwen3_moe"]["mlx"]
    plain, _ = edgemoe.load(path, expert_budget=1.0)
    plain(TOKENS)
    for budget in (1.0, 0.3):
        model, _ = edgemoe.load(path, expert_budget=budget, adapter_path=tmp_path / "adapter")
        assert mx.array_equal(model(TOKENS), expected)
        # no expert's delta is a parameter: each is read into its expert's slot
        names = [k for k, _ in tree_flatten(model.parameters())]
        assert any(k.endswith("self_attn.q_proj.lora_a") for k in names)
        assert not any("switch_mlp" in k for k in names)
        layer = next(iter(model.expert_store.layers.values())).layer
        d, f = model.args.hidden_size, model.args.moe_intermediate_size
        assert layer.delta_bytes == 3 * 4 * (d + f) * 4  # 3 projections, rank 4, float32
        stats, base = model.expert_store.stats, plain.expert_store.stats
        assert stats.bytes_read == stats.loads * layer.expert_bytes  # each with its delta
        assert base.bytes_read == base.loads * (layer.expert_bytes - layer.delta_bytes)
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == \
        ["adapter_config.json", "adapters.safetensors", "expert_deltas.bin",
         "expert_deltas.json"]


def test_a_corrupt_delta_record_is_named_and_a_changed_adapter_rewritten(checkpoints, packs,
                                                                         tmp_path):
    adapter = tmp_path / "adapter"
    mlx_lm_expert_adapter(checkpoints, adapter)
    path = packs["qwen3_moe"]["mlx"]
    edgemoe.load(path, adapter_path=adapter)
    layers = json.loads((adapter / "expert_deltas.json").read_text())["layers"]
    data = bytearray((adapter / "expert_deltas.bin").read_bytes())
    for offset, _, _ in layers[0]["records"]:  # every delta of the first layer
        data[offset + 5] ^= 0xFF
    (adapter / "expert_deltas.bin").write_bytes(bytes(data))
    model, _ = edgemoe.load(path, expert_budget=1.0, adapter_path=adapter)
    with pytest.raises(PackError, match=r"layer 0 expert \d+: checksum mismatch"):
        model(TOKENS)
    # a new adapter in the folder: its records are written again, from it
    (adapter / "adapters.safetensors").unlink()
    (adapter / "adapter_config.json").unlink()
    expected = mlx_lm_expert_adapter(checkpoints, tmp_path / "other", seed=6)(TOKENS)
    for name in ("adapters.safetensors", "adapter_config.json"):
        (tmp_path / "other" / name).rename(adapter / name)
    model, _ = edgemoe.load(path, expert_budget=1.0, adapter_path=adapter)
    assert mx.array_equal(model(TOKENS), expected)


def test_a_read_only_adapter_folder_has_its_delta_records_written_to_the_cache(
        checkpoints, packs, tmp_path, monkeypatch):
    """An adapter in a folder the user cannot write (a system-wide install; the tests run
    as root, so its folder only reads as read-only): the records go to the user's cache,
    named after the adapter and the pack, and the next load reads them from there."""
    from edgemoe.format import deltas

    adapter = tmp_path / "adapter"
    expected = mlx_lm_expert_adapter(checkpoints, adapter)(TOKENS)
    writable = os.access
    monkeypatch.setattr(deltas.os, "access", lambda path, mode: writable(path, mode) and
                        Path(path) != adapter)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = packs["qwen3_moe"]["mlx"]
    model, _ = edgemoe.load(path, expert_budget=0.3, adapter_path=adapter)
    assert mx.array_equal(model(TOKENS), expected)
    assert sorted(p.name for p in adapter.iterdir()) == \
        ["adapter_config.json", "adapters.safetensors"]  # nothing written beside it
    (written,) = (tmp_path / "cache" / "edgemoe" / "expert_deltas").iterdir()
    assert sorted(p.name for p in written.iterdir()) == \
        ["expert_deltas.bin", "expert_deltas.json"]
    monkeypatch.setattr(deltas, "_write", None)  # found, not written again
    model, _ = edgemoe.load(path, expert_budget=0.3, adapter_path=adapter)
    assert mx.array_equal(model(TOKENS), expected)


def test_distilling_the_experts_deltas_serves_them_streamed(checkpoints, packs, tmp_path):
    report = distil(tmp_path, checkpoints, packs, tmp_path / "lora", "--routing", "native",
                    "--experts", "--steps", "60", "--lr", "5e-5")
    assert report["after"]["kl_to_teacher"] < 0.9 * report["before"]["kl_to_teacher"]
    saved = mx.load(str(tmp_path / "lora" / "adapters.safetensors"))
    b = saved["model.layers.1.mlp.switch_mlp.down_proj.lora_b"]
    assert b.shape[0] > 1 and 0 < int((mx.abs(b).sum(axis=(1, 2)) > 0).sum()) <= b.shape[0]
    assert (tmp_path / "lora" / "expert_deltas.bin").exists()  # written by the run
    # served (deltas streamed) as trained (every expert's delta resident)
    path = packs["qwen3_moe"]["hf"]
    trained, _ = edgemoe.load(path, expert_budget=1.0)
    apply_lora(trained, rank=8, targets=report["lora"]["keys"])
    trained.load_weights(str(tmp_path / "lora" / "adapters.safetensors"), strict=False)
    served, _ = edgemoe.load(path, expert_budget=0.5, adapter_path=tmp_path / "lora")
    assert mx.array_equal(served(TOKENS), trained(TOKENS))


# ---------------------------------------------------------------- distilled in PyTorch
def test_the_torch_student_is_the_mlx_student(packs, tmp_path):
    """edgemoe.cuda.train's student (the pack dequantized, every expert resident,
    transformers' class, the CUDA backend's routing on the CPU) computes the MLX path's
    logits, native and prerouted, to float32 rounding."""
    torch = pytest.importorskip("torch")
    from edgemoe.cuda import prerouted
    from edgemoe.cuda.train import build, expert_weights

    path = packs["qwen3_moe"]["hf"]
    mlx_model, _ = edgemoe.load(path)
    random_heads(mlx_model, tmp_path / "heads")
    config = json.loads((path / "config.json").read_text())
    source = open_source(path)
    experts = {l.module: expert_weights(source, l) for l in source.layers}
    tokens = np.random.default_rng(3).integers(3, 500, (2, 40))
    for routing in ("native", "prerouted"):
        model = build(path, config, experts)
        if routing == "prerouted":
            prerouted.install(model, None, prerouted.load_heads(tmp_path / "heads", "cpu"),
                              moe_layers=[l.index for l in source.layers])
        with torch.no_grad():
            found = model(torch.from_numpy(tokens), use_cache=False).logits.numpy()
        reference, _ = edgemoe.load(path, routing=routing, prerouter_path=tmp_path / "heads")
        expected = np.array(reference(mx.array(tokens)))
        assert np.abs(found - expected).max() < 1e-4, routing
        if routing == "prerouted":  # (and prerouted is not native here)
            native = np.array(mlx_model(mx.array(tokens)))
            assert np.abs(native - expected).max() > 1e-2


def test_distilled_in_torch_it_serves_on_the_mlx_path(checkpoints, packs, tmp_path):
    """`--backend torch`: the adapter, the experts' deltas too, written in mlx-lm's format
    and measured as the MLX path serves it (deltas streamed); a rerun resumes."""
    pytest.importorskip("torch")
    report = distil(tmp_path, checkpoints, packs, tmp_path / "lora", "--routing", "native",
                    "--experts", "--backend", "torch", "--steps", "60", "--lr", "5e-5")
    assert report["backend"] == "torch"
    assert report["after"]["kl_to_teacher"] < 0.9 * report["before"]["kl_to_teacher"]
    saved = mx.load(str(tmp_path / "lora" / "adapters.safetensors"))
    model, _ = edgemoe.load(packs["qwen3_moe"]["hf"], adapter_path=tmp_path / "lora")
    shapes = {k: v.shape for k, v in tree_flatten(model.parameters()) if "lora" in k}
    dense = {k: v for k, v in saved.items() if ".switch_mlp." not in k}
    assert dense and all(shapes[k] == v.shape for k, v in dense.items())
    layer = next(iter(model.expert_store.layers.values())).layer
    assert {t.name for t in layer.tensors if t.kind.startswith("lora")} == \
        {f"{p}.lora_{k}" for p in ("gate_proj", "up_proj", "down_proj") for k in "ab"}
    again = distil(tmp_path, checkpoints, packs, tmp_path / "lora", "--routing", "native",
                   "--experts", "--backend", "torch", "--steps", "60", "--lr", "5e-5")
    assert again["after"] == report["after"]  # resumed at its end: nothing more to train
