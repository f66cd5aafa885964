"""Sizes checked before work is spent on them: a prompt's text is refused from its byte
size before the tokenizer runs, and a big text is tokenized one at a time, its memory
given back.

No token stands for more bytes of text than the longest token of the vocabulary (its
raw string in UTF-8, which is at least the bytes it decodes to: byte-level BPE spends
1-2 bytes a byte, SentencePiece a 3-byte mark for a 1-byte space), so a text of more
than context x that many bytes cannot fit: it is refused without tokenizing it (8 of
3.9 MB each, tokenized in full before, took a server from 310 MB to 2.7 GB RSS, kept).
A normalizer may shrink text before it is split (NFC composes a letter and its accent),
hence the margin. Texts that may fit but are big are tokenized one at a time: the
tokenizer's buffers for a few MB of text are hundreds of MB, and glibc keeps what was
freed unless asked to give it back (malloc_trim)."""

import ctypes
import gc
import sys
import threading
import time

import mlx.core as mx

from .errors import BadRequest

NORMALIZER_MARGIN = 2  # bytes of input a token's raw bytes may stand for, at most, over 1
BIG_TEXT_BYTES = 1 << 18  # texts from this size up are tokenized one at a time
_BIG = threading.Lock()


def max_token_bytes(tokenizer) -> int:
    """The longest raw token string of the vocabulary (added tokens too), in bytes."""
    return max(len(token.encode("utf-8", "surrogatepass"))
               for token in tokenizer.get_vocab())


def _glibc():
    """glibc, where the process has it; None elsewhere (macOS, musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:
        return None


def give_memory_back():
    """Return freed heap pages to the system (glibc keeps them otherwise)."""
    if (libc := _glibc()) is not None:
        libc.malloc_trim(0)


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD_BYTES = 1 << 17  # glibc's own starting value


def pin_mmap_threshold():
    """Keep glibc's mmap threshold where it starts (128 KB), for the server's life.
    glibc raises it to the size of each big block freed (up to 32 MB), after which
    blocks that size come from its heaps, where freed ones stay between live ones: a
    grammar bomb's lexer or a 30 MB render then held its pages (16 bombs and 16 template
    bombs kept +178 MB after malloc_trim; pinned: +3 MB). Pinned, every big block is
    its own mapping, given back whole when freed."""
    if (libc := _glibc()) is not None:
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


def freeze_loaded_objects():
    """Leave what exists once the model is loaded (its ~226k objects, which live as
    long as the server) out of Python's cyclic collector: its collections then scan
    only what requests made, so IdleTrim's takes milliseconds, not the 0.1-1 s under
    the GIL a full one took, and run often enough to free what refused requests' cycles
    hold (an error's traceback keeps its frames' locals, such as a 5 MB body)."""
    gc.collect()
    gc.freeze()


class IdleTrim:
    """give_memory_back at most every `every_s` seconds, for a server gone idle: what
    refused requests allocated (a 4 MB body's parse, its template's render) is freed
    but kept by glibc until then."""

    def __init__(self, every_s: float = 5.0):
        self.every_s, self.last = every_s, 0.0

    def __call__(self):
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            # MLX keeps freed buffers (finished rows' KV caches, their logits) for reuse;
            # idle, they go back too (on the engine thread, which owns them); so does
            # what only a cycle holds (a refused request's traceback and the frames it
            # keeps), which an idle process, allocating nothing, never collects
            gc.collect()
            mx.clear_cache()
            give_memory_back()


class BoundedTokenizer:
    """The model's tokenizer as the APIs use it: `encode` checks a text's size first;
    everything else is the tokenizer's own."""

    def __init__(self, tokenizer, context_length: int):
        self._inner = tokenizer
        self._context = context_length
        self._token_bytes = None
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def most_bytes(self) -> int:
        """The most bytes of text the context can hold (measured on first use)."""
        with self._lock:
            if self._token_bytes is None:
                self._token_bytes = max_token_bytes(self._inner)
        return self._context * self._token_bytes * NORMALIZER_MARGIN

    def encode(self, text, *args, **kwargs):
        if not isinstance(text, str):
            return self._inner.encode(text, *args, **kwargs)
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > self.most_bytes():
            raise BadRequest(
                f"the prompt is {size} bytes of text: more than the model's context of "
                f"{self._context} tokens can hold (at most {self.most_bytes()} bytes: "
                f"{self._token_bytes} bytes in its longest token, x{NORMALIZER_MARGIN})")
        if size < BIG_TEXT_BYTES:
            return self._inner.encode(text, *args, **kwargs)
        with _BIG:
            try:
                return self._inner.encode(text, *args, **kwargs)
            finally:
                give_memory_back()
