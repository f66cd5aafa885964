"""Quality of a model configuration on a text: perplexity, and agreement with another.

    python -m edgemoe.eval --text heldout.txt --model PACK[,budget=0.25]
    python -m edgemoe.eval --text heldout.txt --model HF_DIR --model PACK,budget=0.25

Each window is one forward call by default; `--stepwise` scores it a token a call with a
KV cache, as decode runs it (for the routing modes, predictions carried from call to call).

A configuration is a path and options: `budget=` (expert budget), `routing=` (native,
advisory, prerouted), `prerouter=` (heads folder), `adapter=` (adapter folder), `experts=`
(experts per token: reduced top-k); the streaming flags (--expert-budget, --routing, ...)
give every configuration's defaults. Without --model the bundled model is evaluated. An edgemoe pack
loads with edgemoe.load, and so does an mlx-lm quantized checkpoint given streaming
options (read in place); any other folder (a Hugging Face or mlx-lm checkpoint) loads
with mlx_lm.load, fully resident. With two configurations it reports, token by token over the same
windows, top-1 agreement and mean KL(first || second) of the next-token distributions.

`--completions N` adds a task users can judge: N lines of the text, evenly spaced, each cut
at the last space before its middle; the model sees up to `--context` tokens before the
cut and completes the line greedily; a completion counts when it reproduces the rest of the
line exactly, and each scores the share of the rest it reproduces before its first wrong
character (held-out code completion, on the bundled model's own domain).
"""

import argparse
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from .cli import tool, tool_parser
from .format.source import BUNDLED_MODEL, source_kind
from .mlx_backend.experts import streaming_of
from .options import StreamOptions
from .routing.modes import routing_report
from .streaming.trace import routing_stats as trace_routing_stats


# the options of `--model PATH,budget=0.25,routing=prerouted`: StreamOptions' fields
SPEC = {"budget": "expert_budget", "routing": "routing", "prerouter": "prerouter_path",
        "adapter": "adapter_path", "experts": "experts_per_token"}


@dataclass
class ModelConfig:
    path: str
    options: Dict[str, str] = field(default_factory=dict)  # SPEC's names

    @classmethod
    def parse(cls, spec: str) -> "ModelConfig":
        path, *opts = spec.split(",")
        options = {}
        for opt in opts:
            key, sep, value = opt.partition("=")
            if not sep or key not in SPEC:
                raise ValueError(f"model option {opt!r}: expected one of "
                                 f"{', '.join(k + '=' for k in SPEC)}")
            options[key] = value
        config = cls(path, options)
        config.stream_options()  # an unknown routing mode fails here
        return config

    def stream_options(self, defaults: Optional[StreamOptions] = None) -> StreamOptions:
        """`defaults` (the streaming flags) with this configuration's own options."""
        given = {SPEC[k]: v for k, v in self.options.items()}
        if "experts_per_token" in given:  # `experts=4`
            given["experts_per_token"] = _count(given["experts_per_token"])
        return StreamOptions.of(defaults, **given)

    def load(self, defaults: Optional[StreamOptions] = None):
        from .hub import resolve

        path = str(resolve(self.path))  # a hub id: its folder in the hub cache
        kind = source_kind(path)
        if kind == "pack" or (kind == "mlx-lm" and set(self.options) - {"adapter"}):
            from .mlx_backend.loader import load

            return load(path, self.stream_options(defaults))
        if set(self.options) - {"adapter"}:
            raise ValueError(f"{self.path}: budget=, routing=, prerouter= and experts= apply "
                             f"to edgemoe packs and mlx-lm quantized checkpoints only")
        from mlx_lm import load

        return load(path, adapter_path=self.options.get("adapter"))

    def __str__(self):
        return ",".join([self.path] + [f"{k}={v}" for k, v in self.options.items()])


def _count(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"model option experts={text}: expected an integer of at least "
                         f"1, found {text!r}") from None


def windows(tokens: List[int], length: int) -> Iterator[np.ndarray]:
    """Non-overlapping windows of `length` + 1 tokens (inputs and their targets)."""
    for start in range(0, len(tokens) - 1, length):
        chunk = tokens[start:start + length + 1]
        if len(chunk) > 1:
            yield np.array(chunk)


def log_probs(model, window: np.ndarray, stepwise: bool = False) -> mx.array:
    """Next-token log-probs over one window: a whole sequence (no cache, fresh routing) in
    one forward call, or `stepwise`, a token a call with a KV cache, as decode runs it."""
    if stepwise:  # (predicted routing carried from call to call)
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(model)
        rows = []
        for token in window[:-1].tolist():
            rows.append(model(mx.array([[token]]), cache=cache)[0, -1])
            mx.eval(rows[-1])
        logits = mx.stack(rows).astype(mx.float32)
    else:
        logits = model(mx.array(window[None, :-1]))[0].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def compare(models: list, tokens: List[int], context: int = 256, desc: str = "eval",
            stepwise: bool = False) -> dict:
    """Summed negative log-likelihood of each model over the same windows of `tokens`;
    with two models also top-1 agreement and summed KL(first || second)."""
    nll = [0.0] * len(models)
    agree, kl, count = 0, 0.0, 0
    for window in tqdm(list(windows(tokens, context)), desc=desc, unit="window"):
        targets = mx.array(window[1:])
        lps = [log_probs(m, window, stepwise) for m in models]
        for i, lp in enumerate(lps):
            nll[i] -= mx.take_along_axis(lp, targets[:, None], axis=-1).sum().item()
        if len(lps) == 2:
            p, q = lps
            agree += (mx.argmax(p, -1) == mx.argmax(q, -1)).sum().item()
            kl += (mx.exp(p) * (p - q)).sum().item()
        count += len(targets)
    result = {"tokens": count, "context": context,
              "nll": [total / count for total in nll],
              "perplexity": [math.exp(total / count) for total in nll]}
    if len(models) == 2:
        result["top1_agreement"] = agree / count
        result["mean_kl"] = kl / count
    return result


MIN_LINE = 16  # characters of a line worth completing (without its indentation)
MAX_COMPLETION = 48  # tokens a completion may take before it counts as wrong


def completion_cases(text: str, count: int) -> List[Tuple[str, str]]:
    """(text before the cut, the rest of the line) for `count` lines spread evenly over
    `text`, each cut at the last space before the middle of its content."""
    cases, start = [], 0
    for line in text.split("\n"):
        content = line.strip()
        body = len(line) - len(line.lstrip())
        cut = line.rfind(" ", body, body + len(content) // 2)
        if len(content) >= MIN_LINE and cut > body:
            cases.append((text[:start + cut + 1], line[cut + 1:].rstrip()))
        start += len(line) + 1
    step = max(1, len(cases) // count) if count else 1
    return cases[::step][:count]


def complete(model, tokenizer, before: str, context: int) -> str:
    """The model's greedy continuation of `before` (its last `context` tokens) up to the
    end of the line."""
    from mlx_lm.generate import generate_step

    prompt = mx.array(tokenizer.encode(before[-8 * context:])[-context:])
    tokens = []
    for (token, _), _ in zip(generate_step(prompt, model), range(MAX_COMPLETION)):
        tokens.append(int(token))
        if "\n" in tokenizer.decode(tokens):
            break
    return tokenizer.decode(tokens).split("\n")[0].rstrip()


def completion_scores(models: list, cases: List[Tuple[str, str]], context: int) -> dict:
    """Exact matches of each model's completions; with two models, how often they agree."""
    outputs = [[complete(model, tok, before, context)
                for before, _ in tqdm(cases, desc="complete", unit="line")]
               for model, tok in models]
    rests = [rest for _, rest in cases]
    result = {"lines": len(cases),
              "exact_match": [sum(o == r for o, r in zip(out, rests)) / len(cases)
                              for out in outputs],
              "prefix_matched": [sum(_matched(o, r) for o, r in zip(out, rests)) / len(cases)
                                 for out in outputs]}
    if len(outputs) == 2:
        result["same_completion"] = sum(a == b for a, b in zip(*outputs)) / len(cases)
    return result


def _matched(completion: str, rest: str) -> float:
    """The share of `rest` that `completion` reproduces before it first differs."""
    same = next((i for i, (a, b) in enumerate(zip(completion, rest)) if a != b),
                min(len(completion), len(rest)))
    return same / len(rest) if rest else 1.0


def evaluate(configs: List[ModelConfig], text: str, context: int = 256,
             max_tokens: Optional[int] = None, routing_stats: bool = False,
             defaults: Optional[StreamOptions] = None, completions: int = 0,
             stepwise: bool = False) -> dict:
    models = [c.load(defaults) for c in configs]
    first = streaming_of(models[0][0])
    if routing_stats:
        if first is None:
            raise ValueError("routing statistics need an edgemoe pack as the first model")
        recorder = first.store.start_trace()
    tokens = models[0][1].encode(text)
    if max_tokens:
        tokens = tokens[:max_tokens + 1]
    scores = compare([m for m, _ in models], tokens, context, stepwise=stepwise)
    result = {"tokens": scores["tokens"], "context": context, "stepwise": stepwise,
              "configs": []}
    for config, (model, _), nll in zip(configs, models, scores["nll"]):
        entry = {"model": str(config), "nll": nll, "perplexity": math.exp(nll)}
        streaming = streaming_of(model)
        if streaming is not None:  # its routing: exact, or how far not
            entry["expert_hit_rate"] = streaming.store.snapshot().hit_rate
            entry.update(routing_report(config.stream_options(defaults).routing,
                                        streaming.experts_per_token))
        result["configs"].append(entry)
    for key in ("top1_agreement", "mean_kl"):
        if key in scores:
            result[key] = scores[key]
    if routing_stats:
        result["routing"] = trace_routing_stats(recorder.as_trace(),
                                                first.store.info().experts_per_layer)
    if completions:
        cases = completion_cases(text, completions)
        if not cases:
            raise ValueError(f"no line of at least {MIN_LINE} characters to complete")
        result["completion"] = completion_scores(models, cases, context)
    return result


@tool("eval")
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--text", required=True, help="A UTF-8 text file")
    p.add_argument("--model", action="append", default=None,
                   help="PATH or hub id (org/name[@revision])"
                        "[,budget=X][,routing=MODE][,prerouter=DIR][,adapter=DIR]"
                        "[,experts=K]; "
                        "give two to compare them (default: the bundled model)")
    p.add_argument("--context", type=int, default=256, help="Tokens per window")
    p.add_argument("--max-tokens", type=int, default=None, help="Evaluate at most this many")
    p.add_argument("--routing-stats", action="store_true",
                   help="Per-layer expert usage and routing entropy of the first model")
    p.add_argument("--completions", type=int, default=0, metavar="N",
                   help="Also complete N lines of the text greedily and count exact matches")
    p.add_argument("--stepwise", action="store_true",
                   help="Score each window a token a forward call, with a KV cache, as "
                        "decode runs it (slower; predicted routing carried from call to "
                        "call)")
    p.add_argument("--json", default=None, help="Also write the result here")
    StreamOptions.add_arguments(p, only=StreamOptions.single_host())
    args = tool_parser(p, "eval").parse_args(argv)
    args.model = args.model or [str(BUNDLED_MODEL)]
    if len(args.model) > 2:
        p.error("give one --model, or two to compare")
    configs = [ModelConfig.parse(s) for s in args.model]
    text = Path(args.text).read_text()
    result = evaluate(configs, text, args.context, args.max_tokens, args.routing_stats,
                      StreamOptions.from_args(args), args.completions, args.stepwise)
    for c in result["configs"]:
        print(f"{c['model']}: perplexity {c['perplexity']:.3f} (nll {c['nll']:.4f} nats/token)")
    if "mean_kl" in result:
        print(f"top-1 agreement {result['top1_agreement']:.2%}, "
              f"mean KL {result['mean_kl']:.5f} nats/token over {result['tokens']} tokens")
    if "completion" in result:
        c = result["completion"]
        matches = ", ".join(f"{m:.1%}" for m in c["exact_match"])
        prefixes = ", ".join(f"{m:.1%}" for m in c["prefix_matched"])
        agree = f"; the two agree on {c['same_completion']:.1%}" if "same_completion" in c else ""
        print(f"line completion over {c['lines']} lines: exact match {matches}; share of "
              f"the line reproduced before the first wrong character {prefixes}{agree}")
    for r in result.get("routing", []):
        print(f"layer {r['layer']}: routing entropy {r['entropy_bits']:.2f} of "
              f"{r['max_entropy_bits']:.2f} bits; experts used "
              f"{sum(c > 0 for c in r['counts'])}/{len(r['counts'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
