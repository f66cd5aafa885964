"""The streaming expert module for Hugging Face MoE blocks: experts live in slots.

It replaces a block's `experts` module and takes what transformers passes it:
(hidden_states (T, D), top_k_index (T, k), top_k_weights (T, k)). The router is the
model's own, so routing is native and exact. The host learns the layer's expert ids
(one device-to-host read per layer, as in the MLX backend), asks the slot pool for
them, and queues the gathered int4 matmuls over the slot arrays; it never waits for
the GPU otherwise (edgemoe/cuda/slots.py orders copies and compute on the device).
"""

from typing import Callable

import numpy as np
import torch
from torch import nn

from ..streaming.calls import run_call
from ..streaming.slots import LayerSlots
from . import int4

DECODE_ROWS = 64  # up to this many rows per matmul, the Triton kernel (on a GPU)


GATED = ("gate_proj", "up_proj", "down_proj")  # mlx-lm's SwitchGLU: down(act(gate(x)) * up(x))
UNGATED = ("fc1", "fc2")  # mlx-lm's SwitchMLP: fc2(act(fc1(x))) (nemotron_h)


class StreamingExperts(nn.Module):
    """An expert bank read from a layer's slots: gated (gate, up, down projections) or
    ungated (fc1, fc2), as the pack's records hold them; `act` is the family's activation.
    `renormalize` scales each token's top-k weights to sum to one (mlx-lm's jamba block
    does, transformers' router does not).
    `advise`, when set (advisory routing), is called with the layer's input once its
    experts are in slots, so that the reads it starts overlap this layer's compute."""

    def __init__(self, slots: LayerSlots, act: Callable, kernel: Callable = None,
                 renormalize: bool = False):
        super().__init__()
        self.slots, self.act, self.kernel = slots, act, kernel
        self.renormalize = renormalize
        self.advise = None  # advisory routing: called with this layer's input (below)
        found = sorted({t.projection for t in slots.layer.tensors})
        variants = [v for v in (GATED, UNGATED) if sorted(v) == found]
        if not variants:
            raise ValueError(f"layer {slots.layer.index}: experts of {found}; the PyTorch "
                             f"backend computes {list(GATED)} or {list(UNGATED)} experts")
        self.projections = variants[0]
        self.gated = self.projections == GATED
        self.quant = {}
        for name in self.projections:
            q = slots.layer.quantization.get(name)
            if not q or q.get("mode", "affine") != "affine":
                raise ValueError(f"layer {slots.layer.index} {name}: the PyTorch backend "
                                 f"computes affine-quantized experts, found {q}")
            self.quant[name] = (q["group_size"], q["bits"])

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        ids = top_k_index.cpu().numpy()  # the host learns this layer's routing (a sync)
        rows = torch.empty((ids.size, hidden_states.shape[-1]), dtype=hidden_states.dtype,
                           device=hidden_states.device)

        def compute(picked, slot_ids):  # the reads are queued: slot refills wait for them
            picked = np.arange(ids.size) if picked is None else picked
            rows[self._index(picked)] = self._mlp(hidden_states, ids, picked,
                                                  slot_ids.reshape(-1))

        routed = None if self.advise is None else lambda: self.advise(hidden_states)
        run_call(self.slots, ids, compute, routed)  # edgemoe's one call protocol
        if self.renormalize:
            top_k_weights = top_k_weights / top_k_weights.sum(dim=-1, keepdim=True)
        rows = rows.view(*ids.shape, -1) * top_k_weights[..., None].to(rows.dtype)
        return rows.sum(dim=1)

    def _mlp(self, x, ids, picked, slot_ids):
        """Outputs of the (token, k) rows `picked` of the flattened routing, whose experts
        are in slots `slot_ids`."""
        k = ids.shape[-1]
        slots = self._index(slot_ids)
        tokens = self._index(picked // k)
        rows = torch.arange(len(picked), device=x.device)
        if not self.gated:
            hidden = self.act(self._qmm(x, "fc1", slots, tokens))
            return self._qmm(hidden, "fc2", slots, rows)
        gate = self._qmm(x, "gate_proj", slots, tokens)
        up = self._qmm(x, "up_proj", slots, tokens)
        hidden = self.act(gate) * up
        return self._qmm(hidden, "down_proj", slots, rows)

    def _qmm(self, x, name, slots, x_rows):
        """Projection `name` of rows `x[x_rows]` by the experts in `slots`; plus, when the
        records carry an adapter's deltas, each expert's own (mlx-lm's LoRASwitchLinear)."""
        arrays = self.slots.arrays
        group_size, bits = self.quant[name]
        args = (x, arrays[f"{name}.weight"], arrays[f"{name}.scales"], arrays[f"{name}.biases"],
                slots, x_rows, group_size, bits)
        if self.kernel is not None and len(slots) <= DECODE_ROWS and (group_size, bits) == (64, 4):
            y = self.kernel(*args)
        else:
            y = int4.gather_qmm(*args)
        if f"{name}.lora_a" not in arrays:
            return y
        z = gather_lora(x, arrays[f"{name}.lora_a"], arrays[f"{name}.lora_b"], slots, x_rows)
        return y + (self.slots.layer.lora_scale * z).to(y.dtype)

    def _index(self, values: np.ndarray) -> torch.Tensor:
        device = self.slots.arrays[next(iter(self.slots.arrays))].device
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)).to(
            device, non_blocking=True)


def gather_lora(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                slots: torch.Tensor, x_rows: torch.Tensor) -> torch.Tensor:
    """out[m] = (x[x_rows[m]] @ A[slots[m]].T) @ B[slots[m]].T, A (slots, rank, in) and
    B (slots, out, rank) as mlx-lm's LoRASwitchLinear holds them, in the wider dtype of
    the activations' and the deltas' (as MLX promotes). Rows go DECODE_ROWS at a time:
    each gathers its expert's A and B, which a long prefill could not afford at once."""
    dtype = torch.promote_types(x.dtype, lora_a.dtype)
    out = x.new_empty(len(slots), lora_b.shape[-2], dtype=dtype)
    for start in range(0, len(slots), DECODE_ROWS):
        part = slice(start, start + DECODE_ROWS)
        a, b = lora_a[slots[part]].to(dtype), lora_b[slots[part]].to(dtype)
        z = torch.bmm(x[x_rows[part]].to(dtype).unsqueeze(1), a.transpose(1, 2))
        out[part] = torch.bmm(z, b.transpose(1, 2)).squeeze(1)
    return out
