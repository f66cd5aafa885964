"""Short chat turns for the bundled model's agent stage (scripts/train_agent_stage.py).

Every turn is a real question with its answer taken from the corpus or the machine, in the
pack's ChatML, its reply ended by <|im_end|>, so that the model learns to end a turn:
- a Python function, class or module of the training corpus, asked what it does (the first
  paragraph of its docstring) or what it takes (its signature, as `ast` prints it);
- a command or function of the manual pages, asked what it does (its NAME line, from
  `whatis`, read from man's own index).
Held out as the corpus is: the Python turns of held-out files, and the man entries whose
name hashes to 0 mod 20, are written apart (chat_heldout.jsonl) and never trained on.

    python scripts/agent_chat_data.py --corpus CORPUS --out RUN
"""

import argparse
import ast
import json
import random
import re
import subprocess
import zlib
from pathlib import Path

HELDOUT_EVERY = 20
MAX_ANSWER = 240           # characters: a short reply, as most chat turns are
SYSTEMS = ("You are a helpful assistant.", "You are a coding assistant. Answer briefly.",
           "Answer the user's question in one or two sentences.")
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the workspace",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}]
ASK_DOC = ("What does `{name}` do?", "Explain `{name}` briefly.", "What is `{name}` for?",
           "In one sentence, what does the {kind} `{name}` do?",
           "Describe the Python {kind} `{name}`.", "What does this {kind} do?\n```python\n{head}\n```")
ASK_SIGNATURE = ("What arguments does `{name}` take?", "What is the signature of `{name}`?",
                 "How do I call `{name}`?")
ASK_MODULE = ("What is this Python module for?\n```python\n{head}\n```",
              "Summarise the module that starts with:\n```python\n{head}\n```")
ASK_MAN = ("What does the `{name}` {kind} do?", "What is `{name}`?",
           "Explain `{name}` in one line.", "What is `{name}({section})` for?")


def summary(doc):
    """A docstring's first paragraph on one line, or None if it is no short plain answer."""
    if not doc:
        return None
    first = " ".join(doc.strip().split("\n\n")[0].split())
    if not 15 <= len(first) <= MAX_ANSWER or first.startswith((">>>", "..", ":", "-")):
        return None
    return first


def python_turns(text, rng):
    """Question/answer pairs from one Python source's docstrings and signatures."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):
        return []
    lines = text.splitlines()
    turns = []
    module_doc = summary(ast.get_docstring(tree))
    if module_doc:
        head = "\n".join(l for l in lines[:40] if l.startswith(("import ", "from ")))[:300]
        if head:
            turns.append((rng.choice(ASK_MODULE).format(head=head), module_doc))
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if node.name.startswith("_"):
            continue
        kind = "class" if isinstance(node, ast.ClassDef) else "function"
        head = lines[node.lineno - 1].strip() if node.lineno <= len(lines) else node.name
        doc = summary(ast.get_docstring(node))
        if doc:
            turns.append((rng.choice(ASK_DOC).format(name=node.name, kind=kind, head=head), doc))
        if kind == "function" and node.args.args and rng.random() < 0.3:
            signature = f"`{node.name}({ast.unparse(node.args)})`"
            if len(signature) <= MAX_ANSWER:
                turns.append((rng.choice(ASK_SIGNATURE).format(name=node.name), signature))
    return turns


def man_entries():
    """(name, section, description) of every manual page man's index knows."""
    out = subprocess.run(["whatis", "--long", "-w", "*"], capture_output=True, text=True).stdout
    entries = []
    for line in out.splitlines():
        found = re.match(r"^(\S+) \((\w+)\)\s+- (.+)$", line)
        if found and 10 <= len(found[3]) <= MAX_ANSWER and "unknown subject" not in found[3]:
            entries.append(found.groups())
    return entries


def man_turn(name, section, description, rng):
    answer = f"`{name}`: {description.rstrip('.')}."
    kind = {"1": "command", "8": "command", "2": "function", "3": "function"}.get(section[:1], "page")
    return rng.choice(ASK_MAN).format(name=name, section=section, kind=kind), answer


def conversation(question, answer, rng):
    """A turn as messages (and tools): a third with a system prompt, a tenth with tools."""
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    if rng.random() < 0.33:
        messages.insert(0, {"role": "system", "content": rng.choice(SYSTEMS)})
    return {"messages": messages, "tools": TOOLS if rng.random() < 0.1 else None}


def build(corpus_dir: Path, out: Path, seed: int = 0):
    rng = random.Random(seed)
    corpus = json.loads((corpus_dir / "corpus.json").read_text())
    split = {"train": [], "heldout": []}
    for domain in corpus.values():
        for part in split:
            for text in domain[part]:
                split[part] += [conversation(q, a, rng) for q, a in python_turns(text, rng)]
    for name, section, description in man_entries():
        part = "heldout" if zlib.crc32(name.encode()) % HELDOUT_EVERY == 0 else "train"
        split[part].append(conversation(*man_turn(name, section, description, rng), rng))
    out.mkdir(parents=True, exist_ok=True)
    for part, turns in split.items():
        rng.shuffle(turns)
        with open(out / f"chat_{part}.jsonl", "w") as f:
            f.writelines(json.dumps(t) + "\n" for t in turns)
        print(f"chat {part}: {len(turns)} turns")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", type=Path, required=True,
                    help="a train_reference_moe.py run folder with corpus.json")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    build(args.corpus, args.out)
