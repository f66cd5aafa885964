"""How agent-sized a pack is: held-out perplexity at 512, 2K, 8K and 32K tokens, and the
share of held-out short chat turns that end with `stop`.

Perplexity: the int4 pack dequantized to float32 in PyTorch (scripts/train_agent_stage.py's
loader, the pack's own rope_theta), or an unquantized checkpoint (RUN/hf) as it is, on the held-out files of the corpus tokenized and joined
by <|endoftext|> as the first stage did; at each length, windows evenly spaced over that
stream (512: 32 windows, the card's protocol; 2K: 4; 8K: 2; 32K: 1), fed in chunks of
2,048 tokens with a KV cache. At 32K it also reports the perplexity of positions 0-2K,
2K-8K and 8K-32K, so that a context that stops helping shows.
Stop: the first N turns of chat_heldout.jsonl (never trained on), each rendered by the
pack's chat template without its reply, generated greedily by edgemoe (the real stack,
mlx-lm's loop, every expert resident; mlx-lm's own load for a checkpoint) up to MAX_TOKENS; the share whose finish reason is
`stop`.

    python scripts/eval_agent_model.py --pack edgemoe/models/fine --corpus CORPUS \
        --chat RUN/chat_heldout.jsonl --json OUT.json [--lengths 512,2048,8192,32768] [--turns 30]
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

WINDOWS = {512: 32, 2048: 4, 8192: 2, 32768: 1}
CHUNK = 2048
MAX_TOKENS = 128
SPANS = ((0, 2048), (2048, 8192), (8192, 32768))


def perplexities(pack: Path, corpus: Path, lengths):
    import torch
    import torch.nn.functional as F
    from transformers import DynamicCache

    import train_agent_stage as stage
    import train_reference_moe as first

    config = json.loads((pack / "config.json").read_text())
    if (pack / "manifest.json").exists():
        model, tok = stage.load_pack(pack, config["rope_theta"], config["max_position_embeddings"])
    else:  # an unquantized checkpoint (RUN/hf)
        from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
        model = AutoModelForCausalLM.from_pretrained(pack, dtype=torch.float32)
        tok = PreTrainedTokenizerFast.from_pretrained(pack)
    model.eval()
    texts = [t for d in json.loads((corpus / "corpus.json").read_text()).values() for t in d["heldout"]]
    eot = tok.convert_tokens_to_ids(first.EOT)
    stream = []
    for enc in tok(texts, add_special_tokens=False)["input_ids"]:
        stream += enc + [eot]
    stream = np.asarray(stream, dtype=np.int64)
    result = {"heldout_tokens": int(len(stream))}
    for length in lengths:
        n = WINDOWS.get(length, 1)
        starts = np.linspace(0, len(stream) - length - 1, n).astype(np.int64)
        nll = []
        tic = time.time()
        for s in starts:
            window = torch.from_numpy(stream[s:s + length + 1])[None]
            cache = DynamicCache(config=model.config)
            with torch.inference_mode():
                for c in range(0, length, CHUNK):
                    chunk = window[:, c:min(c + CHUNK, length)]
                    logits = model(input_ids=chunk, past_key_values=cache, use_cache=True).logits
                    target = window[0, c + 1:c + 1 + chunk.shape[1]]
                    nll.append(F.cross_entropy(logits[0].float(), target, reduction="none").numpy())
        per_position = np.concatenate(nll).reshape(n, length)
        row = {"windows": n, "ppl": float(math.exp(per_position.mean())),
               "seconds": round(time.time() - tic, 1)}
        if length >= SPANS[-1][1]:
            row["spans"] = {f"{a}-{b}": float(math.exp(per_position[:, a:b].mean())) for a, b in SPANS}
        result[str(length)] = row
        print(f"{pack} {length}: {row}", flush=True)
    return result


def stop_share(pack: Path, chat: Path, turns: int):
    import edgemoe

    if (pack / "manifest.json").exists():
        model, tokenizer = edgemoe.load(pack, expert_budget=1.0)
    else:
        from mlx_lm import load
        model, tokenizer = load(str(pack))
    rows = []
    for line in open(chat).readlines()[:turns]:
        turn = json.loads(line)
        prompt = tokenizer.apply_chat_template(turn["messages"][:-1], tools=turn["tools"],
                                               tokenize=False, add_generation_prompt=True)
        text, reason, n = "", None, 0
        for r in edgemoe.stream_generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS):
            text, reason, n = text + r.text, r.finish_reason, r.generation_tokens
        rows.append({"prompt": turn["messages"][-2]["content"], "reply": text,
                     "finish_reason": reason, "tokens": n})
    stopped = sum(r["finish_reason"] == "stop" for r in rows)
    print(f"{pack}: {stopped}/{len(rows)} end with stop", flush=True)
    return {"turns": len(rows), "stop": stopped, "max_tokens": MAX_TOKENS, "share": stopped / len(rows),
            "eos_token_id": sorted(tokenizer.eos_token_ids), "rows": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pack", type=Path, required=True)
    ap.add_argument("--corpus", type=Path, required=True)
    ap.add_argument("--chat", type=Path, required=True)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--lengths", default="512,2048,8192,32768")
    ap.add_argument("--turns", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    out = json.loads(args.json.read_text()) if args.json.exists() else {}
    config = json.loads((args.pack / "config.json").read_text())
    out.update(pack=str(args.pack), rope_theta=config["rope_theta"],
               context=config["max_position_embeddings"])
    if lengths:
        out.setdefault("perplexity", {}).update(perplexities(args.pack, args.corpus, lengths))
        args.json.write_text(json.dumps(out, indent=1))
    if args.turns:
        out["chat"] = stop_share(args.pack, args.chat, args.turns)
    args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
