"""Triton kernel: the gathered int4 expert matmul over slot pools, in MLX's affine format.

    out[m, n] = sum_k x[x_rows[m], k] * (scale[s, n, k // G] * q[s, n, k] + bias[s, n, k // G])
    with s = slots[m]

K is a compile-time constant (a model has two: its hidden and expert widths), so the
group loop unrolls. One program computes BLOCK_N outputs of one row m, walking K one quantization group at
a time: sum_k x*w = scale * sum_k x*q + bias * sum_k x within a group, accumulated in
float32. It reads each expert weight once per row, which is what decode needs (a few
rows per expert); prefill, with many rows per expert, goes through the dequantize-and-
matmul path in edgemoe/cuda/int4.py, which is also the reference the tests check this
kernel against. Installed as `edgemoe.kernels.int4_moe` (pyproject.toml).
"""

import torch
import triton
import triton.language as tl

GROUP = 64  # the quantization group size this kernel is compiled for
BITS = 4


@triton.jit
def _gather_qmv(x_ptr, w_ptr, s_ptr, b_ptr, slot_ptr, xrow_ptr, out_ptr,
                N, stride_x, stride_ws, stride_wn, stride_ss, stride_sn, stride_out,
                K: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_K: tl.constexpr):
    m = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    slot = tl.load(slot_ptr + m).to(tl.int64)
    xrow = tl.load(xrow_ptr + m).to(tl.int64)
    offs_k = tl.arange(0, GROUP_K)
    shift = (offs_k % 8) * 4
    w_base = w_ptr + slot * stride_ws + offs_n[:, None].to(tl.int64) * stride_wn
    s_base = slot * stride_ss + offs_n.to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, GROUP_K):
        g = k0 // GROUP_K
        x = tl.load(x_ptr + xrow * stride_x + k0 + offs_k).to(tl.float32)
        words = tl.load(w_base + (k0 + offs_k[None, :]) // 8, mask=n_ok[:, None], other=0)
        q = ((words >> shift[None, :]) & 0xF).to(tl.float32)
        scale = tl.load(s_ptr + s_base + g, mask=n_ok, other=0).to(tl.float32)
        bias = tl.load(b_ptr + s_base + g, mask=n_ok, other=0).to(tl.float32)
        acc += scale * tl.sum(q * x[None, :], axis=1) + bias * tl.sum(x, axis=0)
    tl.store(out_ptr + m * stride_out + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


def gather_qmv(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor,
               biases: torch.Tensor, slots: torch.Tensor, x_rows: torch.Tensor,
               group_size: int = GROUP, bits: int = BITS, block_n: int = 64) -> torch.Tensor:
    """Same contract as edgemoe.cuda.int4.gather_qmm, for 4-bit, group-64 weights:
    x (R, K); words (S, N, K/8) int32; scales, biases (S, N, K/64); slots, x_rows (M,)."""
    if (group_size, bits) != (GROUP, BITS):
        raise ValueError(f"kernel compiled for int{BITS} g{GROUP}, got int{bits} g{group_size}")
    n, k = words.shape[-2], x.shape[-1]
    if k % GROUP or words.stride(-1) != 1 or scales.stride(-1) != 1 or x.stride(-1) != 1:
        raise ValueError("gather_qmv: K must be a multiple of 64, inner dims contiguous")
    assert scales.stride() == biases.stride()
    out = torch.empty((len(slots), n), dtype=x.dtype, device=x.device)
    grid = (len(slots), triton.cdiv(n, block_n))
    _gather_qmv[grid](x, words, scales, biases, slots, x_rows, out, n,
                      x.stride(0), words.stride(0), words.stride(1),
                      scales.stride(0), scales.stride(1), out.stride(0),
                      K=k, BLOCK_N=block_n, GROUP_K=GROUP)
    return out
