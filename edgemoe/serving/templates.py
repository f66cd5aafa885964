"""Chat templates under bounds: no render may hold a worker past a deadline.

A chat template is a program (Jinja, sandboxed: no files, no code, but loops): one that
loops for ever, or builds a string of gigabytes, would hold the thread that renders it,
and six such requests every worker thread the server has. So every render, the server's
own template included, runs under `POLICY`: past `timeout_s` the render is stopped (an
exception raised in its thread at the next Python instruction, which is where a Jinja
loop spends its time) and past `max_chars` of output it is refused; both are a 400 naming
the template. A request's own template (`chat_template_kwargs.chat_template`) is refused
unless the server was started with --allow-client-templates: a single C-level operation
(one `'x' * 10**9`) runs to its end before any bound can act, so rendering what a client
writes stays the operator's explicit choice.
"""

import ctypes
import threading
from dataclasses import dataclass
from typing import Callable

from .errors import BadRequest

RENDER_TIMEOUT_S = 5.0
MAX_RENDER_CHARS = 16 * 2**20


@dataclass
class TemplatePolicy:
    allow_client: bool = False  # --allow-client-templates
    timeout_s: float = RENDER_TIMEOUT_S  # --template-timeout
    max_chars: int = MAX_RENDER_CHARS


POLICY = TemplatePolicy()  # the server sets it from its arguments


def check_client_args(template_args: dict):
    """A 400 naming the field when a request brings its own template (and the server did
    not opt in)."""
    if template_args.get("chat_template") is not None and not POLICY.allow_client:
        raise BadRequest("'chat_template_kwargs.chat_template' is refused: this server "
                         "renders only its own chat template (start it with "
                         "--allow-client-templates to render a request's own)",
                         "chat_template_kwargs")


def forget_compiled_templates():
    """Drop the templates transformers compiled (it keeps 128, each with the constants
    Jinja folded into it when compiling: a client's `{{ 'x' * 30000000 }}` held 114 MB
    after its request was refused, and 128 distinct ones would hold 128 times that).
    Called after rendering a request's own template; the server's recompiles in ms."""
    from transformers.utils import chat_template_utils

    for name in ("_compile_jinja_template", "_get_template_variables",
                 "_get_template_literal_text"):
        if (clear := getattr(getattr(chat_template_utils, name, None), "cache_clear",
                             None)) is not None:
            clear()


class _Expired(BaseException):
    """Raised inside a render past its deadline (a BaseException: no `except Exception`
    in Jinja or a template's caller swallows it)."""


def _set_async_exc(thread: int, exc):
    """Raise `exc` in `thread` at its next Python instruction; None: no longer."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread), ctypes.py_object(exc) if exc is not None else ctypes.c_void_p())


def bounded_render(render: Callable[[], str], what: str = "the chat template",
                   param: str = "messages") -> str:
    """`render()` on this thread, stopped past POLICY.timeout_s; its text, refused past
    POLICY.max_chars."""
    timeout_s, max_chars = POLICY.timeout_s, POLICY.max_chars
    thread, lock, state = threading.get_ident(), threading.Lock(), ["running"]

    def expire():
        with lock:
            if state[0] == "running":
                state[0] = "expired"
                _set_async_exc(thread, _Expired)

    timer = threading.Timer(timeout_s, expire)
    timer.daemon = True
    timer.start()
    text = None
    try:
        try:
            text = render()
        finally:
            timer.cancel()
            with lock:
                if state[0] == "expired":  # not delivered yet: never outside this call
                    _set_async_exc(thread, None)
                else:
                    state[0] = "done"
    except _Expired:
        pass
    if state[0] == "expired":
        raise BadRequest(f"{what} took over {timeout_s:g} s to render; the render was "
                         f"stopped", param)
    if isinstance(text, str) and len(text) > max_chars:
        size, text = len(text), None  # not kept alive by the error's traceback
        raise BadRequest(f"{what} rendered {size} characters; at most {max_chars} "
                         f"are taken", param)
    return text
