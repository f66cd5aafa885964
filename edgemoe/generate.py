"""Generate text from an edgemoe pack, streaming routed experts from disk.

    python -m edgemoe.generate --model PACK --prompt "..." --expert-budget 25%
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

import mlx.core as mx
from mlx_lm.generate import DEFAULT_MIN_P, DEFAULT_QUANTIZED_KV_START, DEFAULT_TOP_K, str2bool

from .cli import tool, tool_parser
from .hub import resolve as resolve_hub_id
from .machines import machine_defaults
from .mlx_backend.experts import streaming_of
from .mlx_backend.generation import generate
from .options import StreamOptions, number
from .routing.modes import describe_routing
from .sampling_params import MAX_TEMPERATURE, cli_sampler

DEFAULT_PROMPT = "hello"
DEFAULT_MAX_TOKENS = 100


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, found {text!r}")
    return value


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Generate text, streaming MoE experts from disk.")
    p.add_argument("--model", type=str, default=None,
                   help="An edgemoe pack or mlx-lm quantized checkpoint: a folder, or a hub "
                        "id (org/name[@revision]), downloaded into the hub cache (default: "
                        "the model bundled with edgemoe)")
    p.add_argument("--prompt", "-p", default=DEFAULT_PROMPT,
                   help="Message to be processed by the model ('-' reads from stdin)")
    p.add_argument("--max-tokens", "-m", type=number(int, 1), default=DEFAULT_MAX_TOKENS)
    p.add_argument("--temp", type=number(float, 0, MAX_TEMPERATURE), default=0.0,
                   help="Sampling temperature (0, or one whose 1/temp overflows float32: "
                        "greedy)")
    p.add_argument("--top-p", type=number(float, 0, 1), default=1.0, help="Sampling top-p")
    p.add_argument("--min-p", type=number(float, 0, 1), default=DEFAULT_MIN_P,
                   help="Sampling min-p (default: %(default)s, off)")
    p.add_argument("--top-k", type=number(int, 0), default=DEFAULT_TOP_K,
                   help="Sampling top-k (default: %(default)s, off)")
    p.add_argument("--seed", type=int, default=None, help="PRNG seed")
    p.add_argument("--ignore-chat-template", action="store_true",
                   help="Use the raw prompt without the tokenizer's chat template")
    p.add_argument("--chat-template-config", type=json_object, default={},
                   help="Extra arguments of `apply_chat_template`, a JSON object "
                        "(e.g. '{\"enable_thinking\": false}')")
    p.add_argument("--system-prompt", default=None,
                   help="System prompt for the chat template")
    p.add_argument("--extra-eos-token", nargs="+", default=(),
                   help="Tokens that also end generation")
    p.add_argument("--max-kv-size", type=number(int, 1), default=None,
                   help="Keep at most this many tokens in the KV cache (a rotating cache)")
    p.add_argument("--prefill-step-size", type=number(int, 1),
                   default=machine_defaults().prefill_step_size,
                   help="Prompt tokens per prefill step: each reads the experts it needs "
                        "once (default: %(default)s, this machine's: docs/mac.md)")
    p.add_argument("--kv-bits", type=number(int, 1, 8), default=None,
                   help="Quantize the KV cache to this many bits (default: not quantized)")
    p.add_argument("--kv-group-size", type=number(int, 1), default=64,
                   help="Group size of the KV cache quantization (default: %(default)s)")
    p.add_argument("--quantized-kv-start", type=number(int, 0),
                   default=DEFAULT_QUANTIZED_KV_START,
                   help="With --kv-bits, quantize the KV cache from this step (default: "
                        "%(default)s)")
    p.add_argument("--verbose", type=str2bool, default=True,
                   help="Stream the text and print statistics when 'True' or 'T', only "
                        "print the response when 'False' or 'F' (as mlx_lm.generate)")
    add_draft_arguments(p)
    p.add_argument("--prompt-cache-file", default=None,
                   help="A KV cache saved by edgemoe.cache_prompt (or mlx_lm.cache_prompt, "
                        "for the same model): the prompt continues it")
    p.add_argument("--trace", default=None,
                   help="Write the routing of every token and layer to this .npz file")
    StreamOptions.add_arguments(p)
    return tool_parser(p, "generate")


def add_draft_arguments(p: argparse.ArgumentParser):
    """The speculative decoding flags (edgemoe.generate and edgemoe.server)."""
    p.add_argument("--draft-model", default=None,
                   help="An mlx-lm model with the same tokenizer, held in memory, that drafts "
                        "tokens for speculative decoding (the output stays the model's)")
    p.add_argument("--prompt-lookup", action="store_true",
                   help="Draft from n-gram matches in the prompt and the text so far (no "
                        "draft model)")
    p.add_argument("--num-draft-tokens", type=number(int, 1), default=3,
                   help="Tokens drafted per step (default: %(default)s)")


def draft_error(args) -> Optional[str]:
    """Why the draft flags cannot be used together with the others; None when they can."""
    if args.draft_model and args.prompt_lookup:
        return "--draft-model or --prompt-lookup: one draft at a time"
    if not (args.draft_model or args.prompt_lookup):
        return None
    if getattr(args, "max_kv_size", None) is not None:
        return "--max-kv-size with a draft: speculative decoding needs a KV cache it can trim"
    if getattr(args, "kv_bits", None) is not None:
        return "--kv-bits with a draft: the speculative loop keeps the KV cache unquantized"
    if not args.routing.allows_drafts:
        return (f"--routing {args.routing} with a draft: rejected drafts would leave the "
                f"predicted routing of tokens that are gone")
    if getattr(args, "distributed", False):
        return "--distributed with a draft: a group of hosts decodes without one"
    return None


def load_draft(args, tokenizer):
    """The draft of --draft-model / --prompt-lookup for our own loops."""
    from .mlx_backend.drafts import DraftModel
    from .mlx_backend.lookup import PromptLookup

    if args.prompt_lookup:
        return PromptLookup(args.num_draft_tokens)
    from mlx_lm import load as mlx_lm_load
    model, draft_tokenizer = mlx_lm_load(args.draft_model)
    if draft_tokenizer.vocab_size != tokenizer.vocab_size:
        raise ValueError(f"--draft-model {args.draft_model}: expected the model's vocabulary "
                         f"of {tokenizer.vocab_size} tokens, found {draft_tokenizer.vocab_size}")
    return DraftModel(model, args.num_draft_tokens, args.prefill_step_size)


def draft_options(args, tokenizer) -> dict:
    """The draft of --draft-model / --prompt-lookup, verified in our own loop (its length
    adapted to what windows measure: edgemoe.mlx_backend.drafts)."""
    if not (args.draft_model or args.prompt_lookup):
        return {}
    return {"draft_model": load_draft(args, tokenizer)}


def saved_cache(args):
    """(the KV cache in --prompt-cache-file, the model it was made for, its tokenizer
    config, the experts per token it was made with: None, the model's own), checked
    against the flags as mlx_lm.generate checks them."""
    from mlx_lm.models.cache import QuantizedKVCache, load_prompt_cache

    path = Path(args.prompt_cache_file)
    if not path.is_file():
        raise FileNotFoundError(f"--prompt-cache-file {path}: no such file")
    cache, metadata = load_prompt_cache(str(path), return_metadata=True)
    saved = metadata.get("model") or None  # "": the bundled model
    if args.model is not None and saved is not None and \
            Path(args.model).resolve() != Path(saved).resolve():
        raise ValueError(f"--prompt-cache-file {path} was made for the model {saved}, "
                         f"not {args.model}")
    if isinstance(cache[0], QuantizedKVCache) and (
            (args.kv_bits is not None and args.kv_bits != cache[0].bits)
            or args.kv_group_size != cache[0].group_size):
        raise ValueError(f"--prompt-cache-file {path} holds a {cache[0].bits}-bit KV cache "
                         f"in groups of {cache[0].group_size}; --kv-bits/--kv-group-size "
                         f"differ")
    config = json.loads(metadata.get("tokenizer_config") or "{}")
    config.pop("trust_remote_code", None)
    made_with = metadata.get("experts_per_token")  # edgemoe.cache_prompt's, when reduced
    return cache, args.model or saved, config or None, made_with and int(made_with)


def check_cache_experts(path, made_with, experts) -> None:
    """A KV cache made with other experts per token than this run's is refused: its
    prefix would continue as another routing computed it."""
    made_with = made_with or experts.of
    if made_with != experts.used:
        raise ValueError(f"--prompt-cache-file {path} was made with {made_with} experts per "
                         f"token; this run routes to {experts.used} (--experts-per-token)")


def render_chat(tokenizer, messages, args) -> str:
    """The model's chat template rendered as the server renders it: bounded in time and
    size (edgemoe.serving.templates); a template that fails (a sandbox SecurityError, a
    MemoryError, a loop past the deadline) is one line naming it."""
    from .serving.errors import BadRequest
    from .serving.templates import bounded_render

    where = f"{args.model}: its chat template"
    try:
        return bounded_render(lambda: tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True,
            **args.chat_template_config), what=where)
    except BadRequest as e:
        raise ValueError(e.message) from None
    except Exception as e:  # jinja's own message names what the template wanted
        raise ValueError(f"{where} cannot render this prompt: {type(e).__name__}: "
                         f"{' '.join(str(e).split())[:200]}") from None


@tool("generate")
def main(argv=None):
    from .mlx_backend.loader import load

    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    if args.kv_bits is not None and args.max_kv_size is not None:
        parser.error("--kv-bits with --max-kv-size: mlx-lm cannot quantize a rotating KV "
                     "cache")
    if (error := draft_error(args)) is not None:
        parser.error(error)
    if args.seed is not None:
        mx.random.seed(args.seed)
    args.model = resolve_hub_id(args.model)  # a hub id: its folder in the hub cache
    prompt_cache, tokenizer_config = None, None
    if args.prompt_cache_file is not None:
        prompt_cache, args.model, tokenizer_config, made_with = saved_cache(args)
    model, tokenizer = load(args.model, StreamOptions.from_args(args),
                            tokenizer_config=tokenizer_config)
    if prompt_cache is not None:
        check_cache_experts(args.prompt_cache_file, made_with,
                            streaming_of(model).experts_per_token)
    for eos_token in args.extra_eos_token:
        tokenizer.add_eos_token(eos_token)

    prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    prompt = sys.stdin.read() if prompt == "-" else prompt
    use_chat_template = not args.ignore_chat_template and tokenizer.has_chat_template
    if use_chat_template:
        messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
        messages.append({"role": "user", "content": prompt})
        prompt = render_chat(tokenizer, messages, args)
        if prompt_cache is not None:  # the cache holds the turn's start: only the rest
            messages[-1]["content"] = "<query>"
            probe = render_chat(tokenizer, messages, args)
            prompt = prompt[probe.index("<query>"):]
    tokens = tokenizer.encode(prompt, add_special_tokens=not use_chat_template)
    sampler = cli_sampler(args.temp, args.top_p, args.min_p, args.top_k)
    streaming = streaming_of(model)
    store, share = streaming.store, streaming.share
    follower = share is not None and share.rank > 0  # every host computes; host 0 speaks
    if share is not None:  # hosts that sample draw alike
        mx.random.seed(args.seed if args.seed is not None else share.common_seed())
    if follower:
        args.verbose, args.trace = False, None
    trace = store.start_trace() if args.trace else None
    text = generate(model, tokenizer, tokens, verbose=args.verbose,
                    max_tokens=args.max_tokens, sampler=sampler,
                    max_kv_size=args.max_kv_size, prefill_step_size=args.prefill_step_size,
                    kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
                    quantized_kv_start=args.quantized_kv_start, prompt_cache=prompt_cache,
                    **draft_options(args, tokenizer))
    if trace is not None:
        trace.save(args.trace)
    if args.verbose:
        print(f"Page cache held by the expert files: {store.page_cache_bytes() / 1e9:.3f} GB "
              f"({store.info().io} reads)")
        print(f"Routing: {describe_routing(args.routing, streaming.experts_per_token)}")
    if not follower and not args.verbose:
        print(text)


if __name__ == "__main__":
    main()
