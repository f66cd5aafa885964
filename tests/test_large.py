"""convert in bounded memory: checkpoints several times larger than a memory cap convert
under it, to the same bytes, and convert's peak RSS does not grow with the model.

The checkpoints come from scripts/make_large_checkpoint.py (small layer shapes, many
layers): an mlx-lm int4 one and a Hugging Face bf16 one with per-expert tensors.
"""

import filecmp
import json
import subprocess
import sys
from pathlib import Path

import pytest

from edgemoe import constrained

ROOT = Path(__file__).resolve().parents[1]
SHAPE = ["--hidden", "512", "--moe-intermediate", "1024", "--experts", "32", "--heads", "4",
         "--kv-heads", "2", "--head-dim", "128", "--top-k", "4"]
# format: (dtype, layers of the small and the large checkpoint, a cap the large is ~3x
# over); the Hugging Face one in bf16, as such checkpoints ship (float32 would double it)
KINDS = {"mlx": ("float32", 10, 30, "300M"), "hf": ("bfloat16", 3, 14, "450M")}
PEAK = ("import resource, sys; from edgemoe.convert import convert; "
        "convert(sys.argv[1], sys.argv[2]); "
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")


def make(out: Path, fmt: str, dtype: str, layers: int) -> Path:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_large_checkpoint.py"),
                    str(out), "--format", fmt, "--dtype", dtype, "--layers", str(layers),
                    *SHAPE],
                   check=True, capture_output=True)
    return out


def convert_peak_rss(src: Path, dst: Path) -> int:
    r = subprocess.run([sys.executable, "-c", PEAK, str(src), str(dst)], check=True,
                       capture_output=True, text=True)
    return int(r.stdout.split()[-1])


@pytest.fixture(scope="module", params=sorted(KINDS))
def converted(request, tmp_path_factory):
    """Per source kind: the large checkpoint, its pack, and convert's peak RSS for the
    small and the large one."""
    fmt = request.param
    dtype, small_layers, large_layers, cap = KINDS[fmt]
    tmp = tmp_path_factory.mktemp(f"large-{fmt}")
    small = make(tmp / "small", fmt, dtype, small_layers)
    large = make(tmp / "large", fmt, dtype, large_layers)
    peaks = [convert_peak_rss(small, tmp / "small-pack"),
             convert_peak_rss(large, tmp / "large-pack")]
    return fmt, large, tmp / "large-pack", peaks, cap


def test_convert_peak_rss_does_not_grow_with_the_model(converted):
    """3x (mlx) and 4.7x (hf) the layers, the same peak within 64 MB: one layer of experts
    is held at a time. Before, each written layer stayed referenced: 544 -> 1095 MB from
    10 to 30 mlx layers."""
    fmt, _, _, (small, large), _ = converted
    assert large - small < 64 * 2**20, (fmt, small, large)


@pytest.mark.skipif(constrained.why_unavailable() is not None,
                    reason=f"no cgroups here: {constrained.why_unavailable()}")
def test_a_checkpoint_3x_its_memory_cap_converts_under_it_to_the_same_pack(converted,
                                                                          tmp_path):
    fmt, large, reference, _, cap = converted
    size = sum(f.stat().st_size for f in large.glob("*.safetensors"))
    r = subprocess.run(constrained.command("--memory", cap) + [sys.executable, "-m",
                        "edgemoe.convert", "--hf-path", str(large), "--mlx-path",
                        str(tmp_path / "pack")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    peak = int(r.stderr.split("constrained: peak memory ")[-1].split()[0])
    assert size > 2.5 * peak, (size, peak)  # the cap held it (page cache included)
    for name in ("experts.bin", "model.safetensors", "manifest.json"):
        assert filecmp.cmp(tmp_path / "pack" / name, reference / name, shallow=False), name


def test_the_gguf_for_llama_cpp_holds_the_same_weights(tmp_path):
    """scripts/mlx_to_gguf.py (bench_large's llama.cpp row): every tensor of the GGUF,
    dequantized by gguf's own reader, equals the mlx-lm tensor it came from up to the
    float16 rounding of the scales and biases (4-bit codes as Q4_1, the 8-bit routers and
    norms as F32); every llama.cpp qwen3moe tensor of every layer is there."""
    import gguf
    import mlx.core as mx
    import numpy as np
    from mlx_to_gguf import NAMES

    src = make(tmp_path / "mlx", "mlx", "float32", 2)
    dst = tmp_path / "model.gguf"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "mlx_to_gguf.py"), str(src),
                    str(dst)], check=True, capture_output=True)
    weights = {}
    for f in src.glob("model*.safetensors"):
        weights.update(mx.load(str(f)))
    quant = json.loads((src / "config.json").read_text())["quantization"]
    reader = gguf.GGUFReader(dst)
    names = {t.name for t in reader.tensors}
    per_layer = {"attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                 "attn_q_norm", "attn_k_norm", "ffn_gate_inp", "ffn_gate_exps",
                 "ffn_up_exps", "ffn_down_exps"}
    assert names == {"token_embd.weight", "output_norm.weight", "output.weight"} | {
        f"blk.{i}.{t}.weight" for i in range(2) for t in per_layer}
    mlx_of = {v: k for k, v in NAMES.items()}
    for t in reader.tensors:
        parts = t.name.split(".")
        module = (f"model.layers.{parts[1]}.{mlx_of[parts[2]]}" if parts[0] == "blk"
                  else mlx_of[parts[0]])
        w = weights[module + ".weight"]
        if module + ".scales" in weights:
            bits = quant.get(module, quant)["bits"]
            scales, biases = weights[module + ".scales"], weights[module + ".biases"]
            expected = mx.dequantize(w, scales, biases, 64, bits)
            # what float16 scales and biases change: at most half an ulp of each, per code
            slack = np.array(mx.abs(scales).max() * 15 + mx.abs(biases).max()) * 2.0 ** -11
        else:
            expected, slack = w, 0.0
        found = gguf.quants.dequantize(t.data, t.tensor_type).reshape(expected.shape)
        assert np.abs(found - np.array(expected, dtype=np.float32)).max() <= slack + 1e-7, t.name
