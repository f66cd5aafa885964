"""One host of a test group (tests/test_distributed.py), or the single host it is held to.

    mlx.launch --backend ring -n 2 --python PYTHON -- tests/distributed_worker.py RUNS.json
    python tests/distributed_worker.py RUNS.json --alone

RUNS.json lists runs: {"model", "budget", "routing", "out"[, "partition"]}; "{rank}" in a
model path is this host's rank (each host its own shard). Each run greedy-decodes a fixed prompt and
writes OUT.RANK.npz: the logits of every step, the tokens, the (layer, expert) of every
read this host made, and which experts it owns per MoE layer.
"""

import json
import os
import sys

sys.modules.setdefault("torch", None)  # transformers need not import it here (seconds)

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

import edgemoe  # noqa: E402
from edgemoe.distributed import connect  # noqa: E402

PROMPT = "the quick brown fox jumps over the lazy dog and then"
STEPS = 6


def run(spec: dict, group):
    rank = group.rank() if group is not None else 0
    model, tokenizer = edgemoe.load(spec["model"].format(rank=rank),
                                    expert_budget=spec["budget"], routing=spec["routing"],
                                    group=group, partition=spec.get("partition"),
                                    prerouter_path=spec.get("prerouter"))
    store = model.expert_store
    reads, submit = [], store.reader.submit

    def logged(fills):
        reads.extend((f.layer_index, f.expert) for f in fills)
        return submit(fills)

    store.reader.submit = logged
    cache = make_prompt_cache(model)
    logits = model(mx.array(tokenizer.encode(PROMPT))[None], cache=cache)[:, -1]
    steps, tokens = [np.array(logits.astype(mx.float32))], []
    for _ in range(STEPS):
        tokens.append(int(mx.argmax(logits, axis=-1).item()))
        logits = model(mx.array([[tokens[-1]]]), cache=cache)[:, -1]
        steps.append(np.array(logits.astype(mx.float32)))
    np.savez(f"{spec['out']}.{rank}.npz", logits=np.concatenate(steps), tokens=tokens,
             reads=np.array(reads, dtype=np.int64).reshape(-1, 2),
             layers=np.array(store.layer_indices),
             owned=np.array([store.pool(i).owned for i in store.layer_indices]))
    store.close()


def main():
    runs = json.loads(open(sys.argv[1]).read())
    group = None if "--alone" in sys.argv else connect(30)
    for spec in runs:
        run(spec, group)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
