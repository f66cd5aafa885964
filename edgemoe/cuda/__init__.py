"""The CUDA backend: expert slots in GPU memory, filled from SSD through a host tier.

    pip install 'edgemoe[cuda]'
    from edgemoe.cuda import load, greedy
    model, tokenizer = load(pack_path, expert_budget=0.25, io="direct", device="cuda",
                            host_budget="50%")     # edgemoe.load's options, and its own

Nothing in the rest of edgemoe imports this package, and this package imports neither
MLX nor mlx-lm: it runs on a machine that has only PyTorch and transformers.

The data path, SSD -> RAM -> VRAM: the reader threads (edgemoe.streaming.reader, unchanged)
`preadv` a record, with O_DIRECT if asked, into a pinned row of its layer's host tier
(edgemoe.cuda.host: a RAM cache of records with its own budget and policy, or at least
the few staging rows the copies need); the slot memory (edgemoe.cuda.slots) then issues
one asynchronous host-to-device copy on a copy stream and records an event; compute
waits for that event on the GPU, never on the host. A record the tier still holds costs
a copy and no read. The slot state machine and the cache policies are edgemoe.streaming.slots' and
edgemoe.streaming.cache's, shared with the MLX backend; only the slot memory differs. Device
operations go through a small interface (edgemoe.cuda.streams) that tests replace with
a fake device recording every copy, event and wait, and that the CPU implements with
synchronous copies: the whole backend runs, and is tested, on the CPU.

Compute: the model is transformers' own class for the family (edgemoe.cuda.families),
so attention, router (native, exact routing) and KV cache are transformers'; each MoE
block's `experts` module is replaced by one that computes the gathered int4 experts
(SwiGLU, or an ungated MLP) over the slot arrays,
with a Triton kernel for decode (kernels/int4_moe.py) and dequantize-then-matmul
otherwise (edgemoe.cuda.int4, also the CPU path and the kernel's reference).

Why PyTorch and not MLX's CUDA build (`mlx[cuda]`): MLX arrays are immutable, and MLX's
Python API (0.32.4: streams, `synchronize`, `async_eval`) has no events, no way to make
one stream wait on another, and no copy from pinned host memory into an existing device
buffer. A slot refill would be a new array copied from host memory, scattered into the
pool by a functional update whose buffer reuse and ordering MLX decides; keeping a
queued computation from reading a slot being refilled then takes an evaluation, a host
sync, per layer that refills (as the MLX backend's `mx.eval` before `release` does).
PyTorch has pinned tensors, `copy_(non_blocking=True)` on a side stream, events and
`Stream.wait_event`: exactly the ordering this design needs, with no host sync; and
Triton for the int4 kernel. (Not measured against mlx[cuda]: no GPU was at hand when
this was written; scripts/gpu_check.sh measures this backend.) Native routing still
costs one device-to-host read of the router's expert ids per layer (the host decides
what to load), as in the MLX backend.
"""

from .model import greedy, load

__all__ = ["load", "greedy"]
