"""Prefill a prompt once and save its KV cache, as `mlx_lm.cache_prompt` does, for a model
streamed from disk: `edgemoe.generate --prompt-cache-file` (or `mlx_lm.generate`, on the
same mlx-lm checkpoint) then continues from it without prefilling it again.

    python -m edgemoe.cache_prompt [--model DST] --prompt "long context..." \\
        --prompt-cache-file ctx.safetensors [--max-kv-size N] [--kv-bits B] STREAMING

The file is mlx-lm's (`save_prompt_cache`, with the model and tokenizer config as its
metadata), so files from either tool work with both where the model is the same.
"""

import argparse
import json
import sys
import time

import mlx.core as mx
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START, generate_step
from mlx_lm.models.cache import make_prompt_cache, save_prompt_cache

from .cli import tool, tool_parser
from .mlx_backend.experts import streaming_of
from .options import StreamOptions, number


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Save a prompt's KV cache for later generation "
                                            "(mlx_lm.cache_prompt for streamed models).")
    p.add_argument("--model", default=None,
                   help="An edgemoe pack or mlx-lm checkpoint (default: the bundled MoE)")
    p.add_argument("--prompt", required=True, help="The prompt to cache ('-' reads stdin)")
    p.add_argument("--prompt-cache-file", required=True,
                   help="Where to write the cache (.safetensors)")
    p.add_argument("--max-kv-size", type=number(int, 1), default=None,
                   help="Keep at most this many tokens in the KV cache (a rotating cache)")
    p.add_argument("--kv-bits", type=number(int, 1, 8), default=None,
                   help="Quantize the KV cache to this many bits (default: not quantized)")
    p.add_argument("--kv-group-size", type=number(int, 1), default=64)
    p.add_argument("--quantized-kv-start", type=number(int, 0),
                   default=DEFAULT_QUANTIZED_KV_START)
    StreamOptions.add_arguments(p, only=StreamOptions.single_host())
    return tool_parser(p, "cache_prompt")


@tool("cache_prompt")
def main(argv=None):
    from .mlx_backend.loader import load

    args = setup_arg_parser().parse_args(argv)
    model, tokenizer = load(args.model, StreamOptions.from_args(args))
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if tokenizer.has_chat_template:  # as mlx_lm.cache_prompt: the user turn, left open
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                               add_generation_prompt=False,
                                               continue_final_message=True)
    else:
        prompt = tokenizer.encode(text)
    cache = make_prompt_cache(model, args.max_kv_size)
    start = time.perf_counter()

    def progress(done, total):
        rate = done / max(time.perf_counter() - start, 1e-9)
        print(f"\rProcessed {done:6d} of {total} tokens ({rate:6.2f} tok/s)", end="",
              flush=True)

    for _ in generate_step(mx.array(prompt), model, max_tokens=0, prompt_cache=cache,
                           kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
                           quantized_kv_start=args.quantized_kv_start,
                           prompt_progress_callback=progress):
        pass
    print()
    metadata = {"model": args.model or "", "tokenizer_config": json.dumps({})}
    streaming = streaming_of(model)
    if streaming.experts_per_token.reduced:  # its KV holds reduced routing: so must its use
        metadata["experts_per_token"] = str(streaming.experts_per_token.used)
    save_prompt_cache(args.prompt_cache_file, cache, metadata)
    stats = streaming.store.snapshot()
    print(f"Saved the KV cache of {len(prompt)} tokens to {args.prompt_cache_file} "
          f"(experts read: {stats.bytes_read / 1e9:.3f} GB)")


if __name__ == "__main__":
    main()
