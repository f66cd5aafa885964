"""The recovery LoRA: an unmerged delta beside the int4 matmuls, in mlx-lm's format."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.tuner.utils import linear_to_lora_layers

import edgemoe
from edgemoe.lora import apply_lora, default_targets, save_adapter

TOKENS = mx.array(np.random.default_rng(2).integers(3, 500, (1, 12)))


def randomize_deltas(model, seed=0):
    """Non-zero A and B, as after training."""
    rng = np.random.default_rng(seed)
    model.update(tree_unflatten([
        (k, mx.array(rng.normal(0, 0.05, v.shape).astype(np.float32)))
        for k, v in tree_flatten(model.trainable_parameters())]))


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
