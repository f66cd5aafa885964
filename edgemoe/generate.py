"""Generate text from an edgemoe pack, streaming routed experts from disk.

    python -m edgemoe.generate --model PACK --prompt "..." --expert-budget 25%
"""

import argparse
import sys

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler

from .cache import DEFAULT_POLICY, POLICIES
from .generation import generate
from .loader import ROUTING_MODES
from .telemetry import page_cache_bytes

DEFAULT_PROMPT = "hello"
DEFAULT_MAX_TOKENS = 100


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Generate text, streaming MoE experts from disk.")
    p.add_argument("--model", type=str, default=None,
                   help="An edgemoe pack or mlx-lm quantized checkpoint "
                        "(default: the reference MoE bundled with edgemoe)")
    p.add_argument("--prompt", "-p", default=DEFAULT_PROMPT,
                   help="Message to be processed by the model ('-' reads from stdin)")
    p.add_argument("--max-tokens", "-m", type=int, default=DEFAULT_MAX_TOKENS)
    p.add_argument("--temp", type=float, default=0.0, help="Sampling temperature")
    p.add_argument("--top-p", type=float, default=1.0, help="Sampling top-p")
    p.add_argument("--seed", type=int, default=None, help="PRNG seed")
    p.add_argument("--ignore-chat-template", action="store_true",
                   help="Use the raw prompt without the tokenizer's chat template")
    p.add_argument("--system-prompt", default=None)
    p.add_argument("--verbose", type=lambda s: s.lower() in ("1", "true", "yes"),
                   default=True, help="Stream the text and print statistics")
    p.add_argument("--expert-budget", default="1.0",
                   help="Memory for routed experts: a fraction (0.25), a percentage "
                        "(25%%) or a size (2GB)")
    p.add_argument("--routing", default="native", choices=ROUTING_MODES,
                   help="native: the router decides, experts load on demand; advisory: "
                        "the next layer's experts are prefetched, same output; prerouted: "
                        "the prerouter's prediction is the routing (needs --prerouter); "
                        "prerouted-set: the predicted experts, native weights")
    p.add_argument("--prerouter", default=None,
                   help="Trained prerouter heads (edgemoe.train_prerouter --out DIR: DIR/prerouter)")
    p.add_argument("--io", default="buffered", choices=("buffered", "direct"),
                   help="direct: O_DIRECT reads that bypass the page cache")
    p.add_argument("--cache-policy", default=DEFAULT_POLICY, choices=sorted(POLICIES),
                   help="Which resident expert to evict when a layer's slots are full")
    p.add_argument("--trace", default=None,
                   help="Write the routing of every token and layer to this .npz file")
    p.add_argument("--adapter-path", default=None)
    return p


def main(argv=None):
    from .loader import load

    args = setup_arg_parser().parse_args(argv)
    if args.seed is not None:
        mx.random.seed(args.seed)
    try:
        model, tokenizer = load(args.model, expert_budget=args.expert_budget,
                                adapter_path=args.adapter_path, routing=args.routing,
                                cache_policy=args.cache_policy, io=args.io,
                                prerouter_path=args.prerouter)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"edgemoe.generate: error: {e}")

    prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    prompt = sys.stdin.read() if prompt == "-" else prompt
    use_chat_template = not args.ignore_chat_template and tokenizer.has_chat_template
    if use_chat_template:
        messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
        messages.append({"role": "user", "content": prompt})
        prompt = tokenizer.apply_chat_template(messages, tokenize=False,
                                               add_generation_prompt=True)
    tokens = tokenizer.encode(prompt, add_special_tokens=not use_chat_template)
    sampler = make_sampler(args.temp, args.top_p)
    trace = model.expert_store.start_trace() if args.trace else None
    text = generate(model, tokenizer, tokens, verbose=args.verbose,
                    max_tokens=args.max_tokens, sampler=sampler)
    if trace is not None:
        trace.save(args.trace)
    if args.verbose:
        cached = sum(page_cache_bytes(f) for f in model.expert_store.pack.files)
        print(f"Page cache held by the expert files: {cached / 1e9:.3f} GB "
              f"({model.expert_store.reader.io} reads)")
    if not args.verbose:
        print(text)


if __name__ == "__main__":
    main()
