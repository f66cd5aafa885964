"""The error boundary of every tool (`python -m edgemoe.X`).

An expected failure (a missing, damaged or refused file, a full disk, a permission, an
option the model cannot take) prints one line, `edgemoe.X: error: ...`, naming the file
or option, and exits with status 1. Our own errors for those are ValueErrors (PackError,
BudgetError, UnsupportedModelError) or OSErrors. Anything else is a bug and keeps its
traceback; `--debug` (or EDGEMOE_DEBUG=1) shows the traceback of an expected one too.
"""

import argparse
import functools
import os
import sys

from .options import EXPERIMENTAL_TITLE
from .whatif import experimental  # noqa: F401  (offers --cache-policy learned)

EXPECTED = (ValueError, OSError)


def add_debug_flag(parser):
    parser.add_argument("--debug", action="store_true",
                        help="On an error, print its traceback, not only its message")


def tool_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """Every tool's prologue, once its flags are added: --debug, which the error boundary
    (`tool`) reads, and --help ordered for a newcomer (`arrange`)."""
    add_debug_flag(parser)
    return arrange(parser, name)


def message(e: BaseException) -> str:
    """One line for an expected error; an OSError as `file: reason`."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.filename}: {e.strerror}" if e.filename is not None else e.strerror
    return " ".join(str(e).split()) or type(e).__name__


def tool(name: str):
    """Wrap a tool's `main(argv=None)` in the error boundary."""

    def wrap(main):
        @functools.wraps(main)
        def run(argv=None):
            given = sys.argv[1:] if argv is None else argv
            debug = "--debug" in given or bool(os.environ.get("EDGEMOE_DEBUG"))
            try:
                return main(argv)
            except EXPECTED as e:
                if debug:
                    raise
                sys.exit(f"edgemoe.{name}: error: {message(e)}")
            except KeyboardInterrupt:
                if debug:
                    raise
                sys.exit(f"edgemoe.{name}: interrupted")

        return run

    return wrap


# --- what each tool's --help shows first, and what it sets apart ----------------------

# The flags a newcomer needs, in the order --help lists them (tests/test_cli.py holds each
# tool to its list; docs/cli.md gives the full reference).
ESSENTIAL = {
    "generate": ["--model", "--prompt", "--max-tokens", "--expert-budget", "--routing", "--io",
                 "--temp", "--top-p", "--seed"],
    "server": ["--model", "--host", "--port", "--expert-budget", "--routing", "--io",
               "--max-batch"],
    "eval": ["--model", "--text", "--max-tokens", "--context", "--expert-budget", "--routing"],
    "doctor": ["--model", "--memory", "--expert-budget", "--trace"],
    "convert": ["--hf-path", "--mlx-path", "--q-mode", "--q-bits"],
    "cache_prompt": ["--model", "--prompt", "--prompt-cache-file", "--expert-budget"],
    "verify": ["--model", "--rebuild"],
    "train_prerouter": ["--model", "--data", "--eval-data", "--out", "--same-token"],
    "train_lora": ["--model", "--teacher", "--data", "--eval-data", "--out", "--rank",
                   "--experts", "--steps", "--backend"],
}
def arrange(parser: argparse.ArgumentParser, tool_name: str) -> argparse.ArgumentParser:
    """Order `parser`'s --help for a newcomer: the tool's ESSENTIAL flags first, in their
    own group and at the head of the usage line, the "experimental" group last. Only the
    help changes: parsing is the same."""
    by_flag = {flag: action for action in parser._actions for flag in action.option_strings}

    def move(flags, group):
        for flag in flags:
            action = by_flag[flag]
            for other in parser._action_groups:
                if action in other._group_actions:
                    other._group_actions.remove(action)
            group._group_actions.append(action)

    first = ESSENTIAL.get(tool_name, [])
    if first:
        essential = parser.add_argument_group("essential")
        move(first, essential)
        parser._action_groups.remove(essential)
        at = 1 if parser._action_groups[0] is parser._positionals else 0
        parser._action_groups.insert(at, essential)
        # the usage line too: help, then the essentials, then the rest as they were added
        ordered = [by_flag[f] for f in first]
        parser._actions[:] = ([a for a in parser._actions if isinstance(a, argparse._HelpAction)]
                              + ordered + [a for a in parser._actions if a not in ordered
                                           and not isinstance(a, argparse._HelpAction)])
    for group in [g for g in parser._action_groups if g.title == EXPERIMENTAL_TITLE]:
        parser._action_groups.remove(group)
        parser._action_groups.append(group)
    return parser


# --- `edgemoe COMMAND ...` -----------------------------------------------------------

COMMANDS = {
    "generate": "generate text, streaming experts from disk",
    "server": "serve OpenAI's, Anthropic's and Ollama's APIs",
    "doctor": "will a model fit here, at which budget, how fast (a hub id: before download)",
    "convert": "repack a checkpoint into an edgemoe pack",
    "eval": "perplexity, agreement and completions of one model or two",
    "cache_prompt": "save a prompt's KV cache",
    "verify": "check a model's checksums (index an mlx-lm checkpoint's)",
    "cache_sim": "replay routing traces through cache policies",
    "train_prerouter": "train prerouter heads",
    "train_lora": "distil a recovery LoRA adapter",
    "constrained": "run a command under a memory / disk read-rate cap (cgroups)",
}


def main(argv=None):
    """The `edgemoe` command: `edgemoe COMMAND ARGS...` runs `python -m edgemoe.COMMAND
    ARGS...` (both work; pyproject.toml installs this one as a console script)."""
    import importlib

    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        width = max(map(len, COMMANDS))
        print("usage: edgemoe COMMAND [ARGS...]    (the same as python -m edgemoe.COMMAND)\n\n"
              "Run Mixture-of-Experts models whose experts stay on disk.\n\ncommands:\n"
              + "\n".join(f"  {name.replace('_', '-'):<{width}}  {line}"
                          for name, line in COMMANDS.items())
              + "\n\n`edgemoe COMMAND --help` shows a command's flags, the essential ones "
                "first.")
        return 0 if argv else 2
    if argv[0] == "--version":
        from . import __version__

        print(f"edgemoe {__version__}")
        return 0
    name = argv[0].replace("-", "_")
    if name not in COMMANDS:
        sys.exit(f"edgemoe: error: unknown command {argv[0]!r}; choose one of "
                 f"{', '.join(n.replace('_', '-') for n in COMMANDS)}")
    sys.argv[0] = f"edgemoe {argv[0]}"  # each tool's usage line names the command
    return importlib.import_module(f"edgemoe.{name}").main(argv[1:])
