"""llama.cpp itself: its log routed to Python logging, the backend started once, the
version, the state flags, errors, and the fingerprint of a model file."""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path

import llama_cpp as _ll

log = logging.getLogger(__name__)
llama_log = logging.getLogger("proxy.llama")

FLAGS_FULL = 0
FLAGS_PARTIAL = int(_ll.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
LLAMA_CPP_VERSION = str(_ll.__version__)


def gpu_offload() -> bool:
    """Whether this build of llama.cpp offloads layers to a GPU (CUDA, Metal...)."""
    return bool(_ll.llama_supports_gpu_offload())

# ggml.h in this version: NONE=0, DEBUG=1, INFO=2, WARN=3, ERROR=4, CONT=5 (llama-cpp-python's
# own _logger still assumes the older order, so we install our own callback).
_LEVELS = {0: logging.CRITICAL, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING,
           4: logging.ERROR}


class _LogBridge:
    """Routes llama.cpp's log lines to Python logging, joining partial lines."""

    def __init__(self) -> None:
        self._buf: list[str] = []
        self._level = logging.DEBUG
        self.callback = _ll.llama_log_callback(self._on_log)

    def _on_log(self, level: int, text: bytes, _user: ctypes.c_void_p) -> None:
        if level != 5:
            self._level = _LEVELS.get(level, logging.DEBUG)
        if not llama_log.isEnabledFor(self._level):
            return
        self._buf.append(text.decode("utf-8", "replace"))
        if self._buf[-1].endswith("\n"):
            llama_log.log(self._level, "%s", "".join(self._buf).rstrip("\n"))
            self._buf.clear()


_bridge: _LogBridge | None = None
_init_lock = threading.Lock()


def init_backend(verbose: bool = False) -> None:
    """Initialise llama.cpp once and send its log output to ``proxy.llama``.

    Quiet by default (warnings and errors only); ``verbose`` passes everything.
    """
    global _bridge
    with _init_lock:
        llama_log.setLevel(logging.DEBUG if verbose else logging.WARNING)
        if _bridge is None:
            _bridge = _LogBridge()
            _ll.llama_log_set(_bridge.callback, ctypes.c_void_p(0))
            _ll.llama_backend_init()


class LlamaError(RuntimeError):
    """llama.cpp refused an operation (load, context creation, decode)."""


class UnencodableText(ValueError):
    """A character the vocabulary cannot encode (llama.cpp would abort the process)."""

    def __init__(self, text: str, index: int) -> None:
        ch = text[index]
        super().__init__(f"the model's vocabulary cannot encode the character {ch!r} "
                         f"(U+{ord(ch):04X}) at offset {index} of the text")
        self.char = ch
        self.index = index


_FP_HEAD = 32 << 20
_FP_SAMPLES = 256
_FP_SAMPLE = 4096


def fingerprint_file(path: str | Path) -> str:
    """A 128-bit hex fingerprint of a GGUF's content, cheap for multi-GB files.

    Hashes the size, the first 32 MiB (header, metadata with the tokenizer,
    tensor table, first weights) and 256 evenly spaced 4 KiB samples of the
    rest, so a fine-tune or a different quantisation changes it.
    """
    import xxhash

    h = xxhash.xxh3_128()
    size = os.path.getsize(path)
    h.update(size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        h.update(f.read(_FP_HEAD))
        rest = size - _FP_HEAD
        if rest > 0:
            step = max(rest // _FP_SAMPLES, _FP_SAMPLE)
            for off in range(_FP_HEAD, size, step):
                f.seek(off)
                h.update(f.read(_FP_SAMPLE))
            f.seek(max(size - _FP_SAMPLE, 0))
            h.update(f.read(_FP_SAMPLE))
    return h.hexdigest()
