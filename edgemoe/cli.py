"""The error boundary of every tool (`python -m edgemoe.X`).

An expected failure (a missing, damaged or refused file, a full disk, a permission, an
option the model cannot take) prints one line, `edgemoe.X: error: ...`, naming the file
or option, and exits with status 1. Our own errors for those are ValueErrors (PackError,
BudgetError, UnsupportedModelError) or OSErrors. Anything else is a bug and keeps its
traceback; `--debug` (or EDGEMOE_DEBUG=1) shows the traceback of an expected one too.
"""

import functools
import os
import sys

EXPECTED = (ValueError, OSError)


def add_debug_flag(parser):
    parser.add_argument("--debug", action="store_true",
                        help="On an error, print its traceback, not only its message")


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
