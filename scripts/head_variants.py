"""Train next-token prerouter heads of another width or depth than the shipped shape, with
`edgemoe.train_prerouter`'s own loop, features and evaluation (issue #52: docs/routing.md,
"Wider and deeper heads"). The runtime loads only the shipped shape (256 wide, one hidden
layer), so these heads are for their report's recall, not for serving.

    python scripts/head_variants.py --width 512 --depth 1 -- --model edgemoe/models/fine \\
        --data RUN/train.txt --eval-data RUN/heldout.txt --out DIR \\
        --max-train-tokens 128000 --max-eval-tokens 16384 --epochs 2

Everything after `--` goes to train_prerouter. DIR/features from another run of the same
data can be linked in (`cp -al`) to skip recording them again.
"""

import argparse

import mlx.core as mx
import mlx.nn as nn

import edgemoe.mlx_backend.prerouter as prerouter
import edgemoe.train_prerouter as train_prerouter


def head_class(width: int, depth: int) -> type:
    class Head(nn.Module):
        """The shipped head's inputs and output; `width` hidden units, `depth` hidden
        layers (those after the first are residual)."""

        def __init__(self, hidden_size: int, num_experts: int):
            super().__init__()
            self.norm = nn.RMSNorm(hidden_size)
            self.up = nn.Linear(hidden_size + 2 * num_experts, width)
            self.mid = [nn.Linear(width, width) for _ in range(depth - 1)]
            self.down = nn.Linear(width, num_experts)

        def __call__(self, x: mx.array, *routed: mx.array) -> mx.array:
            h = nn.silu(self.up(mx.concatenate([self.norm(x.astype(mx.float32)), *routed],
                                               axis=-1)))
            for layer in self.mid:
                h = h + nn.silu(layer(h))
            return self.down(h)

    return Head


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=prerouter.HEAD_HIDDEN)
    p.add_argument("--depth", type=int, default=1)
    p.add_argument("rest", nargs=argparse.REMAINDER, help="-- train_prerouter's arguments")
    args = p.parse_args()
    prerouter.PrerouterHead = head_class(args.width, args.depth)
    train_prerouter.HEAD_HIDDEN = args.width  # (its report's head_hidden)
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    train_prerouter.main(rest)


if __name__ == "__main__":
    main()
