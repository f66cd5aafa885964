"""The CUDA backend, on the CPU, on an mlx-lm int4 checkpoint read in place (no pack):
each expert read as slices of the checkpoint's stacked tensors, against the MLX path
reading the same folder."""

import numpy as np
import pytest

pytest.importorskip("torch", reason="the CUDA backend needs PyTorch (edgemoe[cuda])")
pytest.importorskip("transformers", reason="the CUDA backend needs transformers")

import edgemoe  # noqa: E402
from edgemoe.cuda.model import greedy, load  # noqa: E402
from edgemoe.format.source import open_source, source_kind  # noqa: E402
from edgemoe.mlx_backend.families import find_experts  # noqa: E402
from edgemoe.streaming.budget import minimum_bytes  # noqa: E402
from test_cuda_backend import DECODE, LOGIT_TOLERANCE, mlx_greedy, prompt  # noqa: E402


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_an_mlx_lm_checkpoint_read_in_place_gives_the_mlx_paths_logits(family, checkpoints):
    path = checkpoints[family][1]
    assert source_kind(path) == "mlx-lm"
    amount = minimum_bytes(open_source(path, find_experts=find_experts))
    reference, _ = edgemoe.load(str(path), expert_budget=amount)
    ref_tokens, ref_logits = mlx_greedy(reference, prompt(500))
    reference.expert_store.close()
    model, _ = load(path, expert_budget=amount, device="cpu", tokenizer=False)
    run = greedy(model, prompt(500), DECODE)
    store = model.expert_store
    info, stats = store.info(), store.stats
    store.close()
    assert info.in_place
    assert run.tokens == ref_tokens
    assert np.abs(run.logits.numpy() - ref_logits).max() < LOGIT_TOLERANCE
    assert stats.evictions > 0
