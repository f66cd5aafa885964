"""A recovery LoRA served unmerged by the CUDA backend (edgemoe.cuda.lora), on the CPU,
against the MLX path serving the same adapter (edgemoe.load(..., adapter_path=...)).

The bundled model's own adapter moves its logits by more than 0.1 (ADAPTER_EFFECT; the coarse
model's moved them by about 3), far beyond the 1e-3 the backends must agree within (they
agree within ~1.2e-5): a backend that dropped the delta, or applied it wrongly, could not
pass.
"""

import json
import shutil
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the CUDA backend needs PyTorch (edgemoe[cuda])")
pytest.importorskip("transformers", reason="the CUDA backend needs transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

import edgemoe  # noqa: E402
from edgemoe.cuda.lora import LoRALinear  # noqa: E402
from edgemoe.format.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS  # noqa: E402
from edgemoe.cuda.model import DEFAULT_MODEL, greedy, load  # noqa: E402
from edgemoe.format.deltas import expert_deltas, with_deltas  # noqa: E402
from edgemoe.format.pack import Pack, PackError  # noqa: E402
from edgemoe.streaming.budget import minimum_bytes  # noqa: E402
from test_cuda_backend import DECODE, LOGIT_TOLERANCE, mlx_greedy, prompt  # noqa: E402

PACK_ADAPTER = DEFAULT_MODEL / "adapter"
ADAPTER_EFFECT = 100 * LOGIT_TOLERANCE  # the least the bundled adapter moves a logit
TARGET = "model.layers.2.self_attn.q_proj"  # the module a wrong adapter spoils


def budget(name):
    """A fraction, or the least bytes that serve the pack with its adapter's expert deltas
    (each slot holds its expert's delta too)."""
    if name == "25%":
        return 0.25
    source = Pack.open(DEFAULT_MODEL)
    deltas = expert_deltas(PACK_ADAPTER, source)
    return minimum_bytes(source if deltas is None else with_deltas(source, deltas))


@pytest.fixture(scope="module")
def runs():
    """(backend, adapter, budget) -> (tokens, logits, store stats) on the bundled model:
    backend "mlx" (edgemoe.load) or "cpu" (edgemoe.cuda.load on the CPU)."""
    cache = {}

    def get(backend, adapter, amount):
        key = (backend, str(adapter), amount)
        if key not in cache:
            if backend == "mlx":
                model, _ = edgemoe.load(None, expert_budget=amount, adapter_path=adapter)
                tokens, logits = mlx_greedy(model, prompt(500))
            else:
                model, _ = load(None, expert_budget=amount, device="cpu", tokenizer=False,
                                adapter_path=adapter)
                run = greedy(model, prompt(500), DECODE)
                tokens, logits = run.tokens, run.logits.numpy()
            stats = model.expert_store.stats
            model.expert_store.close()
            cache[key] = (tokens, logits, stats)
        return cache[key]

    return get


def wrong_adapter(tmp_path, spoil):
    """A copy of the pack's adapter with its tensors changed by `spoil(name, tensor)`."""
    out = tmp_path / "adapter"
    shutil.copytree(PACK_ADAPTER, out)
    weights = load_file(str(out / ADAPTER_WEIGHTS))
    save_file({n: spoil(n, t).contiguous() for n, t in weights.items()},
              str(out / ADAPTER_WEIGHTS))
    return out


@pytest.mark.parametrize("amount", ["25%", "minimum"])
def test_the_pack_adapter_gives_the_mlx_paths_tokens_and_logits(amount, runs):
    amount = budget(amount)
    ref_tokens, ref_logits, _ = runs("mlx", "pack", amount)
    tokens, logits, stats = runs("cpu", "pack", amount)
    _, plain, _ = runs("cpu", None, amount)
    assert tokens == ref_tokens
    assert np.abs(logits - ref_logits).max() < LOGIT_TOLERANCE
    assert np.abs(logits - plain).max() > ADAPTER_EFFECT, "the adapter must change the logits"
    assert stats.evictions > 0


def test_a_spoiled_b_matrix_changes_the_output_as_on_the_mlx_path(runs, tmp_path):
    """One module's B zeroed: the backend no longer matches the MLX path with the right
    adapter, and matches it with the same wrong one; every B zeroed gives the logits of
    no adapter bit for bit: the delta is all the adapter adds, the base is untouched."""
    amount = budget("minimum")
    _, right, _ = runs("mlx", "pack", amount)
    one = wrong_adapter(tmp_path / "one", lambda n, t: 0 * t if n == f"{TARGET}.lora_b" else t)
    ref_tokens, ref_wrong, _ = runs("mlx", one, amount)
    tokens, wrong, _ = runs("cpu", one, amount)
    assert np.abs(wrong - right).max() > 10 * LOGIT_TOLERANCE
    assert tokens == ref_tokens and np.abs(wrong - ref_wrong).max() < LOGIT_TOLERANCE

    none = wrong_adapter(tmp_path / "none", lambda n, t: 0 * t if n.endswith("lora_b") else t)
    assert np.array_equal(runs("cpu", none, amount)[1], runs("cpu", None, amount)[1])


def test_the_delta_is_served_unmerged_on_frozen_weights():
    plain, _ = load(None, expert_budget=0.25, device="cpu", tokenizer=False)
    adapted, _ = load(None, expert_budget=0.25, device="cpu", tokenizer=False, adapter_path="pack")
    for model in (plain, adapted):
        model.expert_store.close()
    config = json.loads((PACK_ADAPTER / ADAPTER_CONFIG).read_text())
    wrapped = {n: m for n, m in adapted.named_modules() if isinstance(m, LoRALinear)}
    expected = {f"model.layers.{i}.{key}" for i in range(adapted.config.num_hidden_layers)
                for key in config["lora_parameters"]["keys"] if ".switch_mlp." not in key}
    assert set(wrapped) == expected
    for name, module in wrapped.items():
        base = plain.get_submodule(name)
        assert torch.equal(module.linear.weight, base.weight), f"{name}: merged"
        assert not module.linear.weight.requires_grad
        assert module.scale == config["lora_parameters"]["scale"]
        x = torch.randn(3, base.in_features)
        delta = module.scale * (x @ module.lora_a) @ module.lora_b
        assert torch.allclose(module(x), base(x) + delta, atol=1e-6)
        assert delta.abs().max() > 1e-3
    assert not any("gate" in n.split(".") for n in wrapped), "a router must not be adapted"


def test_the_experts_deltas_stream_into_the_device_slots(checkpoints, packs, tmp_path):
    """mlx-lm's own model with a LoRA of the routed experts (its LoRASwitchLinear) and of an
    attention projection: the backend streams each expert's delta into its slot with its
    record, and gives mlx-lm's tokens and logits at every budget."""
    from mlx_lm.utils import load as mlx_lm_load
    from test_lora import mlx_lm_expert_adapter

    adapter = tmp_path / "adapter"
    ref_tokens, ref_logits = mlx_greedy(mlx_lm_expert_adapter(checkpoints, adapter), prompt(500))
    plain_tokens, plain_logits = mlx_greedy(mlx_lm_load(str(checkpoints["qwen3_moe"][1]))[0],
                                            prompt(500))
    assert np.abs(ref_logits - plain_logits).max() > ADAPTER_EFFECT
    path = packs["qwen3_moe"]["mlx"]
    for amount in (1.0, 0.3):
        model, _ = load(path, expert_budget=amount, device="cpu", tokenizer=False, adapter_path=adapter)
        run = greedy(model, prompt(500), DECODE)
        slots = next(iter(model.expert_store.layers.values()))
        stats = model.expert_store.stats
        model.expert_store.close()
        assert run.tokens == ref_tokens
        assert np.abs(run.logits.numpy() - ref_logits).max() < LOGIT_TOLERANCE
        # no expert's delta is resident: each is read into its expert's slot
        assert {"gate_proj.lora_a", "down_proj.lora_b"} <= set(slots.arrays)
        assert not any(n.endswith("lora_a") and ".mlp." in n for n, _ in model.named_parameters())
        assert stats.bytes_read == stats.loads * slots.layer.expert_bytes > 0
        assert slots.layer.delta_bytes > 0 and (stats.evictions > 0) == (amount < 1)


def one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    return message


def test_a_missing_adapter_folder_is_named(tmp_path):
    with pytest.raises(FileNotFoundError) as error:
        load(None, expert_budget=0.25, device="cpu", tokenizer=False, adapter_path=tmp_path / "nope")
    assert f"{tmp_path / 'nope'}: no such adapter folder" in one_line(error)
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / ADAPTER_CONFIG).write_text("{}")
    with pytest.raises(FileNotFoundError) as error:
        load(None, expert_budget=0.25, device="cpu", tokenizer=False, adapter_path=tmp_path / "half")
    assert f"{tmp_path / 'half' / ADAPTER_WEIGHTS}: missing" in one_line(error)


@pytest.mark.parametrize("renamed, found", [
    ("model.layers.9.self_attn.q_proj", "names no module of the qwen3_moe model"),
    ("model.layers.2.mlp.gate", "is a router"),
    ("model.layers.2.input_layernorm", "is a Qwen3MoeRMSNorm, not a linear layer"),
    ("model.layers.2.mlp.switch_mlp.gate_proj", "expected 128 experts' deltas, found F32 [256, "),
])
def test_a_key_naming_no_linear_layer_is_refused(tmp_path, renamed, found):
    bad = wrong_adapter(tmp_path, lambda n, t: t)
    weights = load_file(str(bad / ADAPTER_WEIGHTS))
    for leaf in ("lora_a", "lora_b"):
        weights[f"{renamed}.{leaf}"] = weights.pop(f"{TARGET}.{leaf}")
    save_file(weights, str(bad / ADAPTER_WEIGHTS))
    threads = threading.active_count()
    with pytest.raises(PackError) as error:
        load(None, expert_budget=0.25, device="cpu", tokenizer=False, adapter_path=bad)
    message = one_line(error)
    assert message.startswith(f"{bad / ADAPTER_WEIGHTS}: {renamed}") and found in message
    assert threading.active_count() == threads, "the store's readers must be closed"


def test_a_wrong_shape_is_refused(tmp_path):
    bad = wrong_adapter(tmp_path, lambda n, t: t[:, :64] if n == f"{TARGET}.lora_b" else t)
    with pytest.raises(PackError) as error:
        load(None, expert_budget=0.25, device="cpu", tokenizer=False, adapter_path=bad)
    r = json.loads((PACK_ADAPTER / ADAPTER_CONFIG).read_text())["lora_parameters"]["rank"]
    assert f"{TARGET}: lora_a (256, {r}), lora_b ({r}, 64); expected (256, {r}) and ({r}, 256)" \
        in one_line(error)
