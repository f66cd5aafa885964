"""MLX's affine quantization in PyTorch: dequantize, and the gathered expert matmul.

MLX packs `32 // bits` values into each uint32 word, the first value in the lowest
bits; every `group_size` consecutive values along the input dimension share a scale
and a bias, and w = scale * q + bias. uint32 words are held as int32 tensors (the same
bits; PyTorch's uint32 lacks shifts): an arithmetic shift followed by the mask gives
the same values.

This pure-PyTorch path is what runs on the CPU, and what the Triton kernel
(kernels/int4_moe.py) is checked against.
"""

import torch

PACKED_BITS = (2, 4, 8)  # MLX's 3-, 5- and 6-bit packings straddle words


def dequantize(words: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor,
               group_size: int = 64, bits: int = 4, dtype=torch.float32) -> torch.Tensor:
    """(..., N, K * bits / 32) words and (..., N, K / group_size) scales -> (..., N, K)."""
    if bits not in PACKED_BITS:
        raise ValueError(f"{bits}-bit weights: the PyTorch backend reads {PACKED_BITS}-bit")
    shifts = torch.arange(0, 32, bits, device=words.device, dtype=torch.int32)
    q = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    q = q.reshape(*words.shape[:-1], -1).to(torch.float32)
    scale = scales.to(torch.float32).repeat_interleave(group_size, -1)
    bias = biases.to(torch.float32).repeat_interleave(group_size, -1)
    return (q * scale + bias).to(dtype)


def gather_qmm(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor,
               biases: torch.Tensor, slots: torch.Tensor, x_rows: torch.Tensor,
               group_size: int = 64, bits: int = 4) -> torch.Tensor:
    """out[m] = x[x_rows[m]] @ W[slots[m]].T, with W the dequantized (slots, N, K) stack.

    Each distinct slot is dequantized once and multiplied with all of its rows: a dense
    matmul per expert, which suits prefill on a GPU as well as any use on the CPU.
    """
    out = x.new_empty(len(slots), words.shape[-2])
    for slot in torch.unique(slots).tolist():
        rows = torch.nonzero(slots == slot).squeeze(1)
        w = dequantize(words[slot], scales[slot], biases[slot], group_size, bits, x.dtype)
        out[rows] = x[x_rows[rows]] @ w.T
    return out
