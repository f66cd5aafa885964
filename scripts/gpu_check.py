"""The CUDA backend on a GPU: exactness against the CPU MLX path, the Triton kernel
against its reference, and a short decode benchmark; a summary, and JSON with --json.

    scripts/gpu_check.sh             # installs what is missing, then runs this
    python scripts/gpu_check.py --device cpu   # the same checks on the CPU (a dry run)

Exactness: the bundled model, native routing, a 64-token prompt then 32
tokens decoded with the MLX path's greedy tokens forced, so that every position's logits
compare even where an argmax would flip. Benchmark: decode at 10% and 25% expert budgets,
each with only the staging rows and with a host-memory tier of half the experts (SSD ->
RAM -> VRAM), with one copy stream and with two, and fully resident (every expert loaded
before timing), buffered and O_DIRECT, on the bundled model and on a synthetic pack
with Qwen3-30B-A3B's expert shapes (random weights, so routing is near uniform: a worst
case for the cache); each step feeds a random token, so that routing varies as it does
over text. Each row gives the hits per tier: device slots, host tier, disk reads.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from edgemoe.cuda.int4 import gather_qmm
from edgemoe.cuda.model import DEFAULT_MODEL, greedy, load
from edgemoe.format.pack import PackLayer, RESIDENT_FILE
from edgemoe.format.writer import ExpertsWriter, record_layout, write_manifest

PROMPT, DECODE, BENCH_TOKENS = 64, 32, 64
# stated tolerances against the CPU MLX path, as docs/cuda.md states them: float32 must match
# logit for logit (max |difference| < 1e-3; logits reach ~16); bfloat16 rounds every
# activation, so it is judged on distributions: mean KL(MLX || backend) per position < 0.01
# nats, and the argmax agreeing with MLX's greedy token at all but one of the positions (a
# near-tie may flip). Measured with PyTorch on the CPU (--device cpu) on the coarse reference
# model, bundled then: float32 1.3e-5; bfloat16 max |difference| 1.5, argmax agreement 100%.
TOLERANCE = {"float32": {"max_abs_diff": 1e-3, "argmax_agreement": 1.0},
             "bfloat16": {"mean_kl": 1e-2, "argmax_agreement": 1 - 1 / DECODE}}
KERNEL_TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}  # relative to max |output|


def mlx_reference(budget):
    """Greedy tokens and logits of the MLX path on the CPU (edgemoe.load)."""
    import edgemoe

    model, _ = edgemoe.load(None, expert_budget=budget)
    prompt = np.random.default_rng(7).integers(3, 4000, PROMPT).tolist()
    tokens, logits = mlx_greedy(model, prompt, DECODE)
    model.expert_store.close()
    return prompt, tokens, logits


def mlx_greedy(model, prompt, decode):
    """Greedy decode with an MLX model: the tokens, and the logits of every position."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    out = model(mx.array(prompt)[None], cache=cache)
    logits, tokens = [out[0]], []
    for _ in range(decode):
        token = mx.argmax(out[:, -1], -1)
        tokens.append(int(token.item()))
        out = model(token[None], cache=cache)
        logits.append(out[0])
    return tokens, np.array(mx.concatenate(logits))


def check_exactness(device, dtypes):
    rows = []
    for budget in (1.0, 0.25):
        prompt, tokens, ref = mlx_reference(budget)
        for dtype in dtypes:
            model, _ = load(None, expert_budget=budget, device=device, dtype=getattr(torch, dtype),
                            tokenizer=False, kernel=_kernel_wanted(device))
            run = greedy(model, prompt, DECODE, forced=tokens)
            model.expert_store.close()
            logits = run.logits.float().cpu().numpy()
            diff = np.abs(logits - ref)
            measured = {"max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
                        "mean_kl": mean_kl(ref, logits),
                        "argmax_agreement": float(np.mean(np.array(run.tokens) == np.array(tokens)))}
            bounds = TOLERANCE[dtype]
            ok = all(measured[k] >= v if k == "argmax_agreement" else measured[k] < v
                     for k, v in bounds.items())
            rows.append({"budget": budget, "dtype": dtype, **measured, "ok": ok,
                         "tolerance": bounds})
    return rows


def mean_kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """Mean over positions of KL(softmax p || softmax q), in nats."""
    def log_softmax(x):
        x = x.astype(np.float64) - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lp, lq = log_softmax(p_logits), log_softmax(q_logits)
    return float((np.exp(lp) * (lp - lq)).sum(-1).mean())


def _kernel_wanted(device):
    """On a GPU the Triton kernel must be there: no quiet dequantize-then-matmul instead."""
    return True if torch.device(device).type == "cuda" else None


def check_kernel(device):
    """The Triton kernel against the PyTorch reference at Qwen3-30B-A3B's shapes."""
    try:
        from edgemoe.kernels.int4_moe import gather_qmv
    except ImportError as e:
        return [{"skipped": f"no Triton ({e})", "ok": False}]
    g = torch.Generator(device=device).manual_seed(0)
    rows = []
    for n, k in ((768, 2048), (2048, 768)):
        words = torch.randint(-2**31, 2**31 - 1, (16, n, k // 8), generator=g,
                              device=device, dtype=torch.int64).to(torch.int32)
        scales = torch.rand(16, n, k // 64, generator=g, device=device) * 0.01
        biases = -8 * scales
        slots = torch.randint(0, 16, (8,), generator=g, device=device)
        x_rows = torch.zeros(8, dtype=torch.int64, device=device)
        for dtype in ("float32", "bfloat16"):
            x = torch.randn(1, k, generator=g, device=device).to(getattr(torch, dtype))
            s, b = scales.to(x.dtype), biases.to(x.dtype)
            expected = gather_qmm(x.float(), words, s, b, slots, x_rows)
            got = gather_qmv(x, words, s, b, slots, x_rows).float()
            rel = float((got - expected).abs().max() / expected.abs().max())
            rows.append({"shape": [n, k], "dtype": dtype, "max_rel_diff": rel,
                         "ok": rel < KERNEL_TOLERANCE[dtype],
                         "us_per_call": _time_us(lambda: gather_qmv(x, words, s, b, slots, x_rows)),
                         # dequantize-then-matmul, what runs without the kernel
                         "reference_us_per_call": _time_us(
                             lambda: gather_qmm(x, words, s, b, slots, x_rows))})
    return rows


def _time_us(fn, reps=50):
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    tic = time.perf_counter()
    for _ in range(reps):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return round((time.perf_counter() - tic) / reps * 1e6, 1)


def synthetic_pack(out: Path, layers=4, experts=128, hidden=2048, moe=768, top_k=8):
    """A qwen3_moe pack with random int4 experts of the given shapes; random resident
    weights, unquantized. Records repeat a few random payloads (their bytes are read
    all the same)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(model_type="qwen3_moe", hidden_size=hidden, moe_intermediate_size=moe,
                  intermediate_size=4 * moe, num_hidden_layers=layers, num_attention_heads=16,
                  num_key_value_heads=4, head_dim=128, num_experts=experts,
                  num_experts_per_tok=top_k, norm_topk_prob=True, decoder_sparse_step=1,
                  mlp_only_layers=[], vocab_size=4096, tie_word_embeddings=False,
                  rms_norm_eps=1e-6, max_position_embeddings=4096)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config))
    with torch.device("meta"):
        shapes = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).state_dict()
    g = torch.Generator().manual_seed(0)
    # unit embeddings: the residual stream stays token-specific, and so does routing
    scale = {"model.embed_tokens.weight": 1.0}
    resident = {name: (torch.ones(t.shape) if "norm" in name
                       else torch.randn(t.shape, generator=g) * scale.get(name, 0.02))
                for name, t in shapes.items() if ".experts." not in name}
    save_file(resident, str(out / RESIDENT_FILE))
    rng = np.random.default_rng(0)
    payloads = [_random_expert(rng, hidden, moe) for _ in range(4)]
    layout = record_layout({k: v[None] for k, v in payloads[0].items()},
                           {k: str(v.dtype) for k, v in payloads[0].items()})
    writer = ExpertsWriter(out / "experts.bin")
    pack_layers = []
    for layer in range(layers):
        records = [writer.write([payloads[e % 4][t.name] for t in layout]) for e in range(experts)]
        quant = {p: {"group_size": 64, "bits": 4, "mode": "affine"}
                 for p in ("gate_proj", "up_proj", "down_proj")}
        pack_layers.append(PackLayer(f"model.layers.{layer}.mlp.switch_mlp", layer, layout,
                                     quant, records))
    write_manifest(out, "qwen3_moe", top_k, pack_layers, writer.close())
    return out


def _random_expert(rng, hidden, moe):
    shapes = {"gate_proj": (moe, hidden), "up_proj": (moe, hidden), "down_proj": (hidden, moe)}
    tensors = {}
    for proj, (n, k) in shapes.items():
        tensors[f"{proj}.weight"] = rng.integers(0, 2**32, (n, k // 8), dtype=np.uint32)
        scales = (rng.random((n, k // 64), dtype=np.float32) * 0.004).astype(np.float32)
        tensors[f"{proj}.scales"] = scales
        tensors[f"{proj}.biases"] = (-7.5 * scales).astype(np.float32)
    return tensors


def bench(path, device, budget, io, host_budget=None, copy_streams=1, tokens=BENCH_TOKENS):
    model, _ = load(path, expert_budget=budget, device=device, io=io, tokenizer=False,
                    kernel=_kernel_wanted(device), host_budget=host_budget,
                    copy_streams=copy_streams)
    store = model.expert_store
    if budget == 1.0:
        _load_everything(store)
    rng = np.random.default_rng(1)
    prompt = rng.integers(3, 4000, 8).tolist()
    forced = rng.integers(3, 4000, tokens).tolist()  # routing varies from token to token
    greedy(model, prompt, 4, keep_logits=False, forced=forced)  # warm up (kernels compile)
    before = store.snapshot()
    run = greedy(model, prompt, tokens, keep_logits=False, forced=forced)
    stats = store.snapshot() - before
    io_used = store.info().io
    store.close()
    return {"pack": Path(path).name, "budget": budget, "io": io_used,
            "host_budget": host_budget, "copy_streams": copy_streams,
            "tok_per_s": round(tokens / run.decode_s, 2),
            "ms_blocked_per_token": round(stats.blocked_s / tokens * 1e3, 3),
            "mb_read_per_token": round(stats.bytes_read / tokens / 1e6, 3),
            "read_gbps": round(stats.read_gbps, 3), "hit_rate": round(stats.hit_rate, 3),
            # per tier, of the experts the layers requested
            "device_hits": stats.hits, "host_hits": stats.host_hits,
            "disk_reads": stats.loads - stats.host_hits}


def _load_everything(store):
    from edgemoe.streaming.calls import passes

    for layer in store.layer_indices:
        pool = store.pool(layer)
        for group in passes(np.arange(pool.layer.num_experts), pool.num_slots):
            pool.ensure(group)
            pool.release()


BENCH_CONFIGS = [(1.0, None, 1)] + [(budget, host, streams) for budget in (0.25, 0.10)
                                    for host in (None, "50%") for streams in (1, 2)]


def run_benchmarks(device, synthetic):
    """(budget, host budget, copy streams) of BENCH_CONFIGS, buffered and direct."""
    from edgemoe.format.source import open_source
    from edgemoe.mlx_backend.families import find_experts
    from edgemoe.streaming.budget import SlotPlan

    rows = []
    for path in [DEFAULT_MODEL, synthetic]:
        plan = SlotPlan.of(open_source(Path(path), find_experts=find_experts))
        least = plan.minimum_bytes / plan.total_bytes  # (the small pack's top-8 of 32)
        for io in ("buffered", "direct"):
            for budget, host_budget, streams in BENCH_CONFIGS:
                if budget < least:
                    continue
                rows.append(bench(path, device, budget, io, host_budget, streams))
                print(f"  {rows[-1]}", flush=True)
    return rows


def verdict(exactness, kernel, cuda: bool) -> bool:
    """Every check passed. On a GPU a kernel row that did not run (skipped, or no row at
    all) is a failure; only the CPU dry run may leave the kernel out."""
    if cuda and not kernel:
        return False
    return all(r.get("ok", not cuda) for r in exactness + kernel)


def summary(result) -> str:
    lines = [f"edgemoe gpu_check on {result['device_name']} (torch {result['torch']})",
             "exactness vs the CPU MLX path (bundled model, native routing, forced tokens):"]
    for r in result["exactness"]:
        bounds = ", ".join(f"{k} {'>=' if k == 'argmax_agreement' else '<'} {v}"
                           for k, v in r["tolerance"].items())
        lines.append(f"  budget {r['budget']:>4} {r['dtype']:>8}: max |diff| "
                     f"{r['max_abs_diff']:.2e}, mean KL {r['mean_kl']:.2e}, argmax agreement "
                     f"{r['argmax_agreement']:.0%} (needs {bounds}) -> "
                     f"{'ok' if r['ok'] else 'FAIL'}")
    lines.append("Triton kernel vs PyTorch reference:")
    for r in result["kernel"]:
        lines.append(f"  {r}")
    lines.append("decode benchmark, forced random tokens (tok/s, ms blocked per token, "
                 "MB read per token):")
    for r in result["bench"]:
        lines.append(f"  {r['pack']:>12} {r['io']:>17} budget {r['budget']:>4} host "
                     f"{r['host_budget'] or '-':>4} streams {r['copy_streams']}: "
                     f"{r['tok_per_s']:8.1f} tok/s {r['ms_blocked_per_token']:8.3f} ms blocked "
                     f"{r['mb_read_per_token']:8.2f} MB/token {r['read_gbps']:6.2f} GB/s "
                     f"hit rate {r['hit_rate']:.2f}, hits device/host/disk "
                     f"{r['device_hits']}/{r['host_hits']}/{r['disk_reads']}")
    lines.append("RESULT: " + ("ok" if result["ok"] else "FAIL"))
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--small", action="store_true",
                        help="a small synthetic pack (the default on the CPU)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device visible to PyTorch; run with --device cpu for a dry run")
    tic = time.perf_counter()
    result = {"device": str(device), "torch": torch.__version__,
              "device_name": torch.cuda.get_device_name(device) if cuda else "cpu"}
    print("exactness ...", flush=True)
    result["exactness"] = check_exactness(device, ["float32", "bfloat16"])
    print("kernel ...", flush=True)
    result["kernel"] = check_kernel(device) if cuda else [{"skipped": "no GPU"}]
    print("benchmark ...", flush=True)
    with tempfile.TemporaryDirectory(prefix="edgemoe-synthetic-", dir=".") as tmp:
        small = args.small or not cuda
        shape = dict(layers=2, experts=32, hidden=512, moe=256) if small else {}
        synthetic = synthetic_pack(Path(tmp) / ("synthetic-small" if small else "synthetic-30b"),
                                   **shape)
        result["bench"] = run_benchmarks(device, synthetic)
    result["ok"] = verdict(result["exactness"], result["kernel"], cuda)
    result["wall_s"] = round(time.perf_counter() - tic, 1)
    print(summary(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
