"""The ggml threadpool a context's decodes run on, reached through ctypes: ggml's
threadpool functions are not in llama-cpp-python's API. A persistent pool keeps its
workers polling between decodes (``engine.thread_poll``) instead of starting threads
for every decode, which stalled the sub-millisecond decodes of tiny models."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import llama_cpp as _ll


class ThreadpoolParams(ctypes.Structure):
    """ggml.h's ``struct ggml_threadpool_params``."""

    _fields_ = [("cpumask", ctypes.c_bool * 512),  # GGML_MAX_N_THREADS
                ("n_threads", ctypes.c_int), ("prio", ctypes.c_int),
                ("poll", ctypes.c_uint32), ("strict_cpu", ctypes.c_bool),
                ("paused", ctypes.c_bool)]


def _loaded(prefix: str) -> list[Path]:
    """Files whose name starts with ``prefix`` that this process has mapped (Linux)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(None, 5)[-1].strip() for line in f if prefix in line}
    except OSError:
        return []
    return sorted(Path(p) for p in paths if Path(p).name.startswith(prefix))


def threadpool_api() -> tuple[Any, Any] | None:
    """(libggml-cpu, libllama) with the threadpool functions typed; None if missing.

    It must be the copy of libggml-cpu that libllama runs: the wheel ships its libraries
    as files, not links (``libggml-cpu.so`` beside ``libggml-cpu.so.0``), and a pool made
    by a second copy runs that copy's code with its own tables never initialised
    (Gemma 3's logits came out NaN)."""
    lib_dir = Path(_ll.__file__).parent / "lib"
    names = _loaded("libggml-cpu") or \
        [p for p in lib_dir.glob("libggml-cpu.*") if p.suffix in (".so", ".dylib")] or \
        sorted(lib_dir.glob("libggml-cpu*"))
    try:
        cpu = ctypes.CDLL(str(names[0]))
        llama = ctypes.CDLL(str((_loaded("libllama.") or sorted(lib_dir.glob("libllama.*")))[0]))
        cpu.ggml_threadpool_params_init.argtypes = [ctypes.POINTER(ThreadpoolParams),
                                                    ctypes.c_int]
        cpu.ggml_threadpool_params_init.restype = None
        cpu.ggml_threadpool_new.argtypes = [ctypes.POINTER(ThreadpoolParams)]
        cpu.ggml_threadpool_new.restype = ctypes.c_void_p
        cpu.ggml_threadpool_free.argtypes = [ctypes.c_void_p]
        cpu.ggml_threadpool_free.restype = None
        llama.llama_attach_threadpool.argtypes = [ctypes.c_void_p, ctypes.c_void_p,
                                                  ctypes.c_void_p]
        llama.llama_attach_threadpool.restype = None
        llama.llama_detach_threadpool.argtypes = [ctypes.c_void_p]
        llama.llama_detach_threadpool.restype = None
    except (IndexError, StopIteration, OSError, AttributeError):
        return None
    return cpu, llama
