"""Typed access to llama.cpp through llama-cpp-python's low-level API.

This is the only module of the project that imports ``llama_cpp``. Everything
above it talks in Python ints, numpy arrays and memoryviews.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import math
import os
import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp as _ll
import numpy as np

from proxy.engine.vocab import VocabFacts, other_facts, spm_facts

log = logging.getLogger(__name__)
llama_log = logging.getLogger("proxy.llama")

FLAGS_FULL = 0
FLAGS_PARTIAL = int(_ll.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
LLAMA_CPP_VERSION = str(_ll.__version__)

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


class MemoryKind(enum.Enum):
    ATTENTION = "attention"  # plain KV cache: seq_rm rolls back anywhere
    SWA = "swa"  # sliding-window attention beside full attention (Gemma 3)
    RECURRENT = "recurrent"  # only recurrent state (Mamba)
    HYBRID = "hybrid"  # recurrent layers beside attention (Qwen3.5, LFM2)


@dataclass(slots=True, frozen=True)
class MemoryInfo:
    kind: MemoryKind
    n_swa: int  # the SWA window, 0 if none
    seq_rm_rollback: bool  # can a live lane be truncated anywhere with seq_rm
    rs_rollback: bool  # does the architecture support n_rs_seq snapshots
    n_rs_seq: int  # snapshots kept per lane in this context (0 = none)
    bytes_per_token: int  # full-state bytes added per consumed token
    bytes_per_lane: int  # full-state bytes independent of length (recurrent part)
    partial_bytes_per_token: int
    partial_bytes_per_lane: int

    @property
    def needs_partial(self) -> bool:
        """Whether in-lane rollback needs a saved partial state (recurrent or SWA)."""
        return not self.seq_rm_rollback

    def to_json(self) -> dict[str, object]:
        return {
            "kind": self.kind.value, "n_swa": self.n_swa, "seq_rm_rollback": self.seq_rm_rollback,
            "rs_rollback": self.rs_rollback, "n_rs_seq": self.n_rs_seq,
            "bytes_per_token": self.bytes_per_token, "bytes_per_lane": self.bytes_per_lane,
            "partial_bytes_per_token": self.partial_bytes_per_token,
            "partial_bytes_per_lane": self.partial_bytes_per_lane,
        }


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


class Model:
    """A loaded GGUF: weights, vocabulary, metadata."""

    def __init__(self, path: str | Path, *, n_gpu_layers: int = -1, verbose: bool = False) -> None:
        init_backend(verbose)
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"model file not found: {self.path}")
        params = _ll.llama_model_default_params()
        params.n_gpu_layers = 2**31 - 1 if n_gpu_layers < 0 else n_gpu_layers
        ptr = _ll.llama_model_load_from_file(str(self.path).encode(), params)
        if not ptr:
            raise LlamaError(f"llama.cpp could not load {self.path}")
        self._ptr = ptr
        self._vocab = _ll.llama_model_get_vocab(ptr)
        self.n_vocab = int(_ll.llama_vocab_n_tokens(self._vocab))
        self.n_ctx_train = int(_ll.llama_model_n_ctx_train(ptr))
        self.n_swa = int(_ll.llama_model_n_swa(ptr))
        self.is_recurrent = bool(_ll.llama_model_is_recurrent(ptr))
        self.is_hybrid = bool(_ll.llama_model_is_hybrid(ptr))
        self.metadata = self._read_metadata()
        self.architecture = self.metadata.get("general.architecture", "")
        self.name = self.metadata.get("general.name") or self.path.stem
        self.fingerprint = fingerprint_file(self.path)
        self.eos = int(_ll.llama_vocab_eos(self._vocab))
        self.add_bos = bool(_ll.llama_vocab_get_add_bos(self._vocab))
        self.bos = int(_ll.llama_vocab_bos(self._vocab))
        # the engine asks for each generated token's piece and end-of-generation flag:
        # a dict lookup, not a call into llama.cpp, once a token has been seen
        self._pieces: dict[int, bytes] = {}
        self._lengths: np.ndarray | None = None  # piece_lengths, filled as tokens are seen
        self._eog: dict[int, bool] = {}
        self._facts: VocabFacts | None = None
        self._facts_lock = threading.Lock()

    @property
    def ptr(self) -> object:
        return self._ptr

    def _read_metadata(self) -> dict[str, str]:
        out: dict[str, str] = {}
        buf = ctypes.create_string_buffer(1 << 16)
        for i in range(int(_ll.llama_model_meta_count(self._ptr))):
            n = _ll.llama_model_meta_key_by_index(self._ptr, i, buf, len(buf))
            if n < 0:
                continue
            key = buf.value.decode("utf-8", "replace")
            n = _ll.llama_model_meta_val_str_by_index(self._ptr, i, buf, len(buf))
            if n >= len(buf):  # long values (chat templates) need a bigger buffer
                big = ctypes.create_string_buffer(n + 1)
                _ll.llama_model_meta_val_str_by_index(self._ptr, i, big, len(big))
                out[key] = big.value.decode("utf-8", "replace")
            elif n >= 0:
                out[key] = buf.value.decode("utf-8", "replace")
        return out

    def chat_template(self) -> str | None:
        return self.metadata.get("tokenizer.chat_template") or None

    def vocab_facts(self) -> VocabFacts:
        """What the vocabulary can encode and how long its tokens are (read once)."""
        with self._facts_lock:
            if self._facts is None:
                self._facts = self._read_vocab_facts()
            return self._facts

    def _read_vocab_facts(self) -> VocabFacts:
        special_attrs = _ll.LLAMA_TOKEN_ATTR_CONTROL | _ll.LLAMA_TOKEN_ATTR_UNKNOWN
        texts: list[bytes] = []
        special: list[bool] = []
        for t in range(self.n_vocab):
            texts.append(_ll.llama_vocab_get_text(self._vocab, t) or b"")
            special.append(bool(_ll.llama_vocab_get_attr(self._vocab, t) & special_attrs))
        kind = int(_ll.llama_vocab_type(self._vocab))
        if kind == _ll.LLAMA_VOCAB_TYPE_SPM:
            return spm_facts(texts, special)
        # BPE falls back to byte tokens without throwing; other kinds have an unknown
        # token that may cover any run of text, so no length bound holds for them.
        return other_facts(texts, special, bounded=kind == _ll.LLAMA_VOCAB_TYPE_BPE)

    def tokenize(self, text: str, *, add_special: bool = False,
                 parse_special: bool = True) -> list[int]:
        """Token ids of ``text``; UnencodableText for a character the vocabulary lacks."""
        bad = self.vocab_facts().first_unencodable(text, parse_special=parse_special)
        if bad is not None:
            raise UnencodableText(text, bad)
        data = text.encode("utf-8")
        cap = len(data) + 8
        arr = (_ll.llama_token * cap)()
        n = _ll.llama_tokenize(self._vocab, data, len(data), arr, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            arr = (_ll.llama_token * cap)()
            n = _ll.llama_tokenize(self._vocab, data, len(data), arr, cap, add_special,
                                   parse_special)
        if n < 0:
            raise LlamaError("tokenization failed")
        return list(arr[:n])

    def token_bytes(self, token: int, *, special: bool = True) -> bytes:
        """The raw bytes of one token; a piece may be part of a UTF-8 character."""
        if special:
            piece = self._pieces.get(token)
            if piece is not None:
                return piece
        self._check_token(token)
        buf = ctypes.create_string_buffer(256)
        n = _ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = _ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        piece = buf.raw[:n]
        if special:
            self._pieces[token] = piece  # one per token the model produced: at most the vocabulary
        return piece

    def piece_lengths(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        """The byte length of each token's piece (special tokens as their text), from a
        table filled as tokens are first seen."""
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.n_vocab):
            raise ValueError("a token id is outside the vocabulary")
        with self._facts_lock:
            if self._lengths is None:
                self._lengths = np.full(self.n_vocab, -1, dtype=np.int32)
            table = self._lengths
        for t in np.unique(ids[table[ids] < 0]).tolist():
            table[t] = len(self.token_bytes(t))
        return table[ids]

    def detokenize(self, tokens: Iterable[int], *, special: bool = True) -> str:
        return b"".join(self.token_bytes(t, special=special) for t in tokens).decode(
            "utf-8", "replace")

    def token_text(self, token: int) -> str:
        raw = _ll.llama_vocab_get_text(self._vocab, token)
        return raw.decode("utf-8", "replace") if raw else ""

    def is_eog(self, token: int) -> bool:
        eog = self._eog.get(token)
        if eog is None:
            self._check_token(token)
            eog = self._eog[token] = bool(_ll.llama_vocab_is_eog(self._vocab, token))
        return eog

    def _check_token(self, token: int) -> None:
        # llama.cpp throws a C++ exception for an id outside the vocabulary, which ends
        # the process: refuse it here
        if not 0 <= token < self.n_vocab:
            raise ValueError(f"token {token} is outside the vocabulary (0 to {self.n_vocab - 1})")

    def is_control(self, token: int) -> bool:
        return bool(_ll.llama_vocab_is_control(self._vocab, token))

    def close(self) -> None:
        if self._ptr is not None:
            _ll.llama_model_free(self._ptr)
            self._ptr = None

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Batch:
    """A preallocated llama_batch spanning any of the context's lanes."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._b = _ll.llama_batch_init(capacity, 0, 1)
        self.n = 0
        self._tok = np.ctypeslib.as_array(self._b.token, shape=(capacity,))
        self._pos = np.ctypeslib.as_array(self._b.pos, shape=(capacity,))
        self._nseq = np.ctypeslib.as_array(self._b.n_seq_id, shape=(capacity,))
        self._logits = np.ctypeslib.as_array(self._b.logits, shape=(capacity,))
        self._nseq[:] = 1

    def clear(self) -> None:
        self.n = 0

    def add(self, lane: int, tokens: Sequence[int] | np.ndarray, pos0: int, *,
            logits_last: bool, logits_from: int = -1) -> int:
        """Append tokens of one lane at positions pos0...; returns the row of the last one.
        Rows get logits from token ``logits_from`` of ``tokens`` on (-1: the last one only,
        if ``logits_last``): a verification needs them for the drafted tokens too."""
        k = len(tokens)
        if self.n + k > self.capacity:
            raise ValueError(f"batch overflow: {self.n}+{k} > {self.capacity}")
        if k == 1:  # a decoding lane: one token, the common case of every step
            i = self.n
            self._tok[i] = tokens[0]
            self._pos[i] = pos0
            self._logits[i] = (logits_from == 0) if logits_from >= 0 else logits_last
            self._b.seq_id[i][0] = lane
            self.n = i + 1
            return i
        s = slice(self.n, self.n + k)
        self._tok[s] = tokens
        self._pos[s] = np.arange(pos0, pos0 + k, dtype=np.int32)
        self._logits[s] = 0
        seq = self._b.seq_id
        for i in range(self.n, self.n + k):
            seq[i][0] = lane
        if logits_from >= 0:
            self._logits[self.n + logits_from: self.n + k] = 1
        elif logits_last and k:
            self._logits[self.n + k - 1] = 1
        self.n += k
        return self.n - 1

    @property
    def raw(self) -> object:
        self._b.n_tokens = self.n
        return self._b

    def free(self) -> None:
        if self._b is not None:
            _ll.llama_batch_free(self._b)
            self._b = None


class StateBuffer:
    """A reusable, growing byte buffer for saving lane states without extra copies."""

    def __init__(self, size: int = 1 << 20) -> None:
        self._arr = (ctypes.c_uint8 * size)()

    def reserve(self, size: int) -> None:
        if size > len(self._arr):
            self._arr = (ctypes.c_uint8 * max(size, 2 * len(self._arr)))()

    @property
    def array(self) -> ctypes.Array[ctypes.c_uint8]:
        return self._arr


class _ThreadpoolParams(ctypes.Structure):
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


def _threadpool_api() -> tuple[Any, Any] | None:
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
        cpu.ggml_threadpool_params_init.argtypes = [ctypes.POINTER(_ThreadpoolParams),
                                                    ctypes.c_int]
        cpu.ggml_threadpool_params_init.restype = None
        cpu.ggml_threadpool_new.argtypes = [ctypes.POINTER(_ThreadpoolParams)]
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


@dataclass(slots=True, frozen=True)
class ContextParams:
    n_ctx: int = 8192
    n_seq_max: int = 1
    n_batch: int = 512
    n_ubatch: int = 512
    n_rs_seq: int = 0
    threads: int = 0  # 0 = all cores
    swa_full: bool = True  # keep every SWA cell so a live lane can be truncated anywhere
    # A persistent ggml threadpool whose workers poll this long (0-100, ggml's scale)
    # before they sleep; -1: none, llama.cpp starts threads for every decode.
    poll: int = -1


class Context:
    """A llama context with ``n_seq_max`` lanes. Not thread-safe: one thread owns it."""

    def __init__(self, model: Model, params: ContextParams) -> None:
        self.model = model
        p = _ll.llama_context_default_params()
        p.n_ctx = params.n_ctx
        p.n_batch = params.n_batch
        p.n_ubatch = params.n_ubatch
        p.n_seq_max = params.n_seq_max
        p.n_rs_seq = params.n_rs_seq
        threads = params.threads or os.cpu_count() or 1
        p.n_threads = threads
        p.n_threads_batch = threads
        p.no_perf = True
        p.swa_full = params.swa_full
        # one KV buffer per lane, so a lane holds n_ctx tokens whatever the others do
        p.kv_unified = False
        ptr = _ll.llama_init_from_model(model.ptr, p)
        if not ptr:
            raise LlamaError(f"llama.cpp could not create a context ({params})")
        self._ptr = ptr
        self.params = params
        self.n_ctx = int(_ll.llama_n_ctx(ptr))
        self.n_ctx_seq = int(_ll.llama_n_ctx_seq(ptr))
        self.n_lanes = int(_ll.llama_n_seq_max(ptr))
        self.n_batch = params.n_batch
        self.n_rs_seq = int(_ll.llama_n_rs_seq(ptr))
        self._mem = _ll.llama_get_memory(ptr)
        self._n_vocab = model.n_vocab
        self._buf = StateBuffer()
        self._views: dict[int, np.ndarray] = {}
        self.batch = Batch(params.n_batch)
        self._pool: int | None = None
        self._pool_owned = True
        self._pool_api = _threadpool_api() if params.poll >= 0 and threads > 1 else None
        if self._pool_api is not None:
            cpu, llama = self._pool_api
            tp = _ThreadpoolParams()
            cpu.ggml_threadpool_params_init(ctypes.byref(tp), threads)
            tp.poll = params.poll
            self._pool = cpu.ggml_threadpool_new(ctypes.byref(tp))
            if self._pool:
                llama.llama_attach_threadpool(ptr, self._pool, self._pool)

    def share_threads(self, other: Context) -> bool:
        """Decode on ``other``'s persistent threadpool (a draft beside its target: one
        thread owns both contexts, so one set of workers serves both, and no idle pool
        polls while the other computes). ``other`` must outlive this context."""
        if not other._pool or other._pool_api is None or self._ptr is None:
            return False
        if self._pool and self._pool_owned and self._pool_api is not None:
            self._pool_api[1].llama_detach_threadpool(self._ptr)
            self._pool_api[0].ggml_threadpool_free(self._pool)
        self._pool_api, self._pool, self._pool_owned = other._pool_api, other._pool, False
        self._pool_api[1].llama_attach_threadpool(self._ptr, self._pool, self._pool)
        return True

    # -- decoding ---------------------------------------------------------

    def decode(self, batch: Batch | None = None) -> None:
        b = batch or self.batch
        if b.n == 0:
            return
        rc = _ll.llama_decode(self._ptr, b.raw)
        if rc != 0:
            raise LlamaError(f"llama_decode failed with {rc}")

    def logits(self, row: int) -> np.ndarray:
        """A copy of the logits of one output row of the last decode (-1 = last)."""
        ptr = _ll.llama_get_logits_ith(self._ptr, row)
        if not ptr:
            raise LlamaError(f"no logits for row {row}")
        return np.ctypeslib.as_array(ptr, shape=(self._n_vocab,)).copy()

    def logits_view(self, row: int) -> np.ndarray:
        """The logits of one output row, not copied: valid until the next decode."""
        ptr = _ll.llama_get_logits_ith(self._ptr, row)
        if not ptr:
            raise LlamaError(f"no logits for row {row}")
        # llama.cpp keeps one output buffer and hands out the same rows step after step:
        # a view per address (a few: rows of the buffer, and a new buffer when it grows)
        addr = ctypes.addressof(ptr.contents)
        view = self._views.get(addr)
        if view is None:
            if len(self._views) >= 256:
                self._views.clear()
            view = self._views[addr] = np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))
        return view

    def prefill(self, lane: int, tokens: Sequence[int] | np.ndarray, pos0: int, *,
                logits_last: bool = True) -> np.ndarray | None:
        """Decode tokens into one lane in n_batch chunks; return the last row's logits."""
        out: np.ndarray | None = None
        for i in range(0, len(tokens), self.n_batch):
            chunk = tokens[i:i + self.n_batch]
            last = i + self.n_batch >= len(tokens)
            self.batch.clear()
            row = self.batch.add(lane, chunk, pos0 + i, logits_last=last and logits_last)
            self.decode()
            if last and logits_last:
                out = self.logits(row)
        return out

    # -- memory -------------------------------------------------------------

    def seq_rm(self, lane: int, p0: int, p1: int = -1) -> bool:
        return bool(_ll.llama_memory_seq_rm(self._mem, lane, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        _ll.llama_memory_seq_cp(self._mem, src, dst, p0, p1)

    def clear_lane(self, lane: int) -> None:
        if not _ll.llama_memory_seq_rm(self._mem, lane, -1, -1):
            raise LlamaError(f"could not clear lane {lane}")

    def clear_all(self) -> None:
        _ll.llama_memory_clear(self._mem, True)

    def pos_max(self, lane: int) -> int:
        return int(_ll.llama_memory_seq_pos_max(self._mem, lane))

    def pos_min(self, lane: int) -> int:
        return int(_ll.llama_memory_seq_pos_min(self._mem, lane))

    # -- state ----------------------------------------------------------------

    def state_size(self, lane: int, flags: int = FLAGS_FULL) -> int:
        return int(_ll.llama_state_seq_get_size_ext(self._ptr, lane, flags))

    def save(self, lane: int, flags: int = FLAGS_FULL,
             buf: StateBuffer | None = None) -> memoryview:
        """Serialise one lane into a reusable buffer; the view is valid until the next save."""
        b = buf or self._buf
        size = self.state_size(lane, flags)
        b.reserve(size)
        n = _ll.llama_state_seq_get_data_ext(self._ptr, b.array, size, lane, flags)
        if n == 0 and size != 0:
            raise LlamaError(f"saving lane {lane} failed")
        return memoryview(b.array).cast("B")[:n]

    def restore(self, lane: int, data: bytes | bytearray | memoryview,
                flags: int = FLAGS_FULL) -> bool:
        """Load a saved state into a lane. On failure the lane is left cleared."""
        arr = np.frombuffer(data, dtype=np.uint8)
        ptr = arr.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        n = _ll.llama_state_seq_set_data_ext(self._ptr, ptr, arr.size, lane, flags)
        if n != arr.size:
            log.warning("restore into lane %d failed (%d of %d bytes read)", lane, n, arr.size)
            if flags == FLAGS_FULL:
                self.clear_lane(lane)
            return False
        return True

    def describe_memory(self, probe_lane: int = 0) -> MemoryInfo:
        """Classify the memory and measure state sizes by probing one (empty) lane."""
        m = self.model
        if m.is_hybrid:
            kind = MemoryKind.HYBRID
        elif m.is_recurrent:
            kind = MemoryKind.RECURRENT
        elif m.n_swa > 0:
            kind = MemoryKind.SWA
        else:
            kind = MemoryKind.ATTENTION
        if self.pos_max(probe_lane) >= 0:
            raise RuntimeError("describe_memory needs an empty lane")
        tok = m.bos if m.bos >= 0 else 0
        self.prefill(probe_lane, [tok], 0, logits_last=False)
        one = (self.state_size(probe_lane, FLAGS_FULL), self.state_size(probe_lane, FLAGS_PARTIAL))
        self.prefill(probe_lane, [tok] * 32, 1, logits_last=False)
        many = (self.state_size(probe_lane, FLAGS_FULL),
                self.state_size(probe_lane, FLAGS_PARTIAL))
        self.clear_lane(probe_lane)
        per_tok = (many[0] - one[0]) // 32
        pper_tok = (many[1] - one[1]) // 32
        return MemoryInfo(
            kind=kind,
            n_swa=m.n_swa,
            seq_rm_rollback=kind is MemoryKind.ATTENTION,
            rs_rollback=self._probe_rs_rollback(),
            n_rs_seq=self.n_rs_seq,
            bytes_per_token=per_tok,
            bytes_per_lane=one[0] - per_tok,
            partial_bytes_per_token=pper_tok,
            partial_bytes_per_lane=one[1] - pper_tok,
        )

    def _probe_rs_rollback(self) -> bool:
        if self.n_rs_seq > 0:
            return True
        if not (self.model.is_recurrent or self.model.is_hybrid):
            return False
        return supports_rs_rollback(self.model)

    def close(self) -> None:
        if self._ptr is not None:
            self.batch.free()
            if self._pool and self._pool_api is not None:
                self._pool_api[1].llama_detach_threadpool(self._ptr)
            _ll.llama_free(self._ptr)
            self._ptr = None
            if self._pool and self._pool_api is not None and self._pool_owned:
                self._pool_api[0].ggml_threadpool_free(self._pool)
            self._pool = None

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def supports_rs_rollback(model: Model) -> bool:
    """Ask llama.cpp: it clamps n_rs_seq to 0 for architectures without snapshots."""
    p = _ll.llama_context_default_params()
    p.n_ctx = 256
    p.n_batch = p.n_ubatch = 32
    p.n_seq_max = 1
    p.n_rs_seq = 1
    ptr = _ll.llama_init_from_model(model.ptr, p)
    if not ptr:
        return False
    try:
        return int(_ll.llama_n_rs_seq(ptr)) > 0
    finally:
        _ll.llama_free(ptr)


# -- sampling ---------------------------------------------------------------------

# llama_token_data as numpy sees it: the candidates a grammar-constrained sample builds.
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
MAX_GRAMMAR_NESTING = 1024  # llama.cpp's grammar parser recurses per parenthesis (30,000 crash)


def _nesting(text: str) -> int:
    """Deepest parenthesis nesting of a GBNF text, outside literals, classes and comments."""
    depth = deepest = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"[":
            end = '"' if c == '"' else "]"
            i += 1
            while i < n and text[i] != end:
                i += 2 if text[i] == "\\" else 1
        elif c == "#":
            while i < n and text[i] != "\n":
                i += 1
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
        i += 1
    return deepest


def check_grammar(text: str, root: str = "root") -> None:
    """ValueError unless llama.cpp parses ``text`` as a GBNF grammar with rule ``root``.

    Parsed without a vocabulary (nothing model-specific is needed), so token references
    (``<[id]>``) are refused here. llama.cpp prints its own parse error on stderr.
    """
    if _nesting(text) > MAX_GRAMMAR_NESTING:
        raise ValueError(f"the grammar nests parentheses deeper than {MAX_GRAMMAR_NESTING}")
    ptr = _ll.llama_sampler_init_grammar(None, text.encode("utf-8"), root.encode("utf-8"))
    if not ptr:
        raise ValueError(f"llama.cpp cannot parse the grammar (a GBNF syntax error, an "
                         f"undefined rule, left recursion, or no '{root}' rule)")
    _ll.llama_sampler_free(ptr)


class SchemaRules:
    """llama.cpp's JSON-schema-to-GBNF converter (llama-cpp-python's port of it): the rules
    of one grammar, for one or more schemas. Whatever the converter raises passes through
    (the caller names the part at fault)."""

    def __init__(self, prop_order: Sequence[str] = ()) -> None:
        from llama_cpp.llama_grammar import SchemaConverter

        self._conv = SchemaConverter(prop_order={k: i for i, k in enumerate(prop_order)},
                                     allow_fetch=False, dotall=False, raw_pattern=False)

    def add(self, schema: dict[str, Any], name: str, url: str) -> str:
        """Rules for ``schema`` (its local ``$ref``s resolved under ``url``); returns the
        name of the rule that matches it. ``schema`` is rewritten in place."""
        return str(self._conv.visit(self._conv.resolve_refs(schema, url), name))

    def text(self) -> str:
        rules = self._conv._rules
        if rules.get("char") == _PORTED_CHAR:
            rules["char"] = _JSON_CHAR
        return str(self._conv.format_grammar())


# The port's string character lets control characters through, which JSON forbids in a
# string (llama.cpp's own converter excludes them): its rule is replaced by this one.
_PORTED_CHAR = r'[^"\\] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])'
_JSON_CHAR = (r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] '
              r'[0-9a-fA-F] [0-9a-fA-F])')


class SamplerChain:
    """One request's llama.cpp sampler chain (seeded), with its grammar kept apart.

    Stages are added in llama-server's order: logit bias, penalties and DRY (they change
    logits), then the filters (top-k, typical, top-p, min-p, XTC) and temperature, then a
    draw (``dist`` or ``greedy``). Without a grammar this is one llama.cpp chain
    (``llama_sampler_sample``). With one, a token is sampled as llama.cpp's common
    sampler does: by the chain alone first; only if the grammar rejects that token, again
    with the grammar applied before the filters. That second pass gives llama-server's
    result without running the grammar over the whole vocabulary (57 ms at Gemma 3's 262K
    tokens) when the likeliest candidates settle it: k of them allowed where the filters
    keep k at most (top-k; greedy keeps one), or one allowed so far above the rest that
    min-p would drop every token outside them. Engine thread only; ``close`` frees it
    (garbage collection does too).
    """

    CHUNKS = (1024, 16384)  # candidates the grammar checks before the whole vocabulary

    def __init__(self, model: Model, grammar: str = "", root: str = "root") -> None:
        self._vocab = model._vocab
        self._n_vocab = model.n_vocab
        self._grammar: object | None = None
        if grammar:
            if _nesting(grammar) > MAX_GRAMMAR_NESTING:
                raise ValueError(f"the grammar nests parentheses deeper than "
                                 f"{MAX_GRAMMAR_NESTING}")
            self._grammar = _ll.llama_sampler_init_grammar(
                self._vocab, grammar.encode("utf-8"), root.encode("utf-8"))
            if not self._grammar:
                raise ValueError("llama.cpp cannot parse the grammar")
        self._chain = _new_chain()
        # with a grammar the logit changes, the filters and the draw are three chains, so
        # the grammar can go between the first two and the draw can run again
        self._mods = _new_chain() if self._grammar else self._chain
        self._draw = _new_chain() if self._grammar else self._chain
        owned = [p for p in {id(x): x for x in (self._chain, self._mods, self._draw,
                                                self._grammar)}.values() if p]
        self._free = weakref.finalize(self, _free_samplers, owned)
        self._keep = 0  # most tokens the filters keep (top-k; 1 for greedy), 0: no bound
        self._min_p = 0.0  # min-p's bound (0: none, or a typical-p stage before it)
        self._typical = False
        self._cur: np.ndarray | None = None  # candidates, made on the first constrained sample
        self._ids = np.empty(0, dtype=np.int32)
        self._one = np.zeros(1, dtype=_TOKEN_DATA)
        self.stages: list[str] = []
        self.rejected = 0  # tokens the grammar rejected, sampled again
        self.settled_early = 0  # ...of which the likeliest candidates settled

    def _add(self, name: str, ptr: object, chain: object) -> None:
        if not ptr:
            raise LlamaError(f"llama.cpp could not create the {name} sampler")
        _ll.llama_sampler_chain_add(chain, ptr)
        self.stages.append(name)

    def logit_bias(self, biases: Sequence[tuple[int, float]]) -> None:
        arr = (_ll.llama_logit_bias * len(biases))(
            *(_ll.llama_logit_bias(int(t), float(b)) for t, b in biases))
        self._add("logit_bias", _ll.llama_sampler_init_logit_bias(self._n_vocab, len(biases), arr),
                  self._mods)

    def penalties(self, last_n: int, repeat: float, frequency: float, presence: float) -> None:
        self._add("penalties", _ll.llama_sampler_init_penalties(
            self._n_vocab, last_n, repeat, frequency, presence), self._mods)

    def dry(self, multiplier: float, base: float, allowed_length: int, last_n: int,
            breakers: Sequence[str]) -> None:
        arr = (ctypes.c_char_p * len(breakers))(*(b.encode("utf-8") for b in breakers))
        self._add("dry", _ll.llama_sampler_init_dry(self._vocab, multiplier, base,
                                                    allowed_length, last_n, arr, len(breakers)),
                  self._mods)

    def top_k(self, k: int) -> None:
        if k > 0:
            self._keep = min(self._keep, k) if self._keep else k
        self._add("top_k", _ll.llama_sampler_init_top_k(k), self._chain)

    def typical(self, p: float) -> None:
        self._typical = True  # it may drop the likeliest token, which min-p measures from
        self._add("typical", _ll.llama_sampler_init_typical(p, 1), self._chain)

    def top_p(self, p: float) -> None:
        self._add("top_p", _ll.llama_sampler_init_top_p(p, 1), self._chain)

    def min_p(self, p: float) -> None:
        self._min_p = max(self._min_p, p)
        self._add("min_p", _ll.llama_sampler_init_min_p(p, 1), self._chain)

    def xtc(self, probability: float, threshold: float, seed: int) -> None:
        self._add("xtc", _ll.llama_sampler_init_xtc(probability, threshold, 1, seed),
                  self._chain)

    def temperature(self, t: float) -> None:
        self._add("temp", _ll.llama_sampler_init_temp(t), self._chain)

    def dist(self, seed: int) -> None:
        self._add("dist", _ll.llama_sampler_init_dist(seed), self._draw)

    def greedy(self) -> None:
        self._keep = 1
        self._add("greedy", _ll.llama_sampler_init_greedy(), self._draw)

    def accept(self, token: int) -> None:
        """Record a token the context consumed that this chain did not sample (the prompt's,
        for the penalties); never passed to the grammar."""
        _ll.llama_sampler_accept(self._mods, token)

    def sample(self, ctx: Context, row: int) -> int:
        """Sample and accept the next token from output row ``row`` of the last decode."""
        if self._grammar is None:
            return int(_ll.llama_sampler_sample(self._chain, ctx._ptr, row))
        logits = ctx.logits_view(row)
        arr = self._fill(logits)
        _ll.llama_sampler_apply(self._mods, ctypes.byref(arr))
        _ll.llama_sampler_apply(self._chain, ctypes.byref(arr))
        tok = self._pick(arr)
        if not self.allows(tok):
            tok = self._constrained(logits)
        _ll.llama_sampler_accept(self._grammar, tok)
        for chain in (self._mods, self._chain, self._draw):
            _ll.llama_sampler_accept(chain, tok)
        return tok

    def _constrained(self, logits: np.ndarray) -> int:
        """The token the chain samples with the grammar applied before its filters."""
        self.rejected += 1
        arr = self._fill(logits)
        _ll.llama_sampler_apply(self._mods, ctypes.byref(arr))
        cur = self._cur
        assert cur is not None
        # min-p keeps the tokens whose logit is at least the best one's + log(p)
        gap = math.log(self._min_p) if self._min_p > 0 and not self._typical else -math.inf
        for size in self.CHUNKS if self._keep or gap > -math.inf else ():
            if size >= len(cur):
                break
            chunk = cur[np.argpartition(-cur["logit"], size)[:size]]
            floor = float(chunk["logit"].min())  # no token outside the chunk scores more
            _ll.llama_sampler_apply(self._grammar, ctypes.byref(_candidates(chunk)))
            allowed = chunk[np.isfinite(chunk["logit"])]
            # the filters keep ``_keep`` at most: that many found, the rest cannot matter;
            # nor can they when min-p drops every token scoring ``floor`` or less
            if len(allowed) and (self._keep and len(allowed) >= self._keep
                                 or floor < float(allowed["logit"].max()) + gap):
                self.settled_early += 1
                return self._filter_and_pick(_candidates(allowed))
        _ll.llama_sampler_apply(self._grammar, ctypes.byref(arr))
        tok = self._filter_and_pick(arr)
        if not self.allows(tok):
            raise RuntimeError("the grammar allows no token here")
        return tok

    def _filter_and_pick(self, arr: Any) -> int:
        _ll.llama_sampler_apply(self._chain, ctypes.byref(arr))
        return self._pick(arr)

    def _fill(self, logits: np.ndarray) -> Any:
        if self._cur is None:
            self._cur = np.zeros(self._n_vocab, dtype=_TOKEN_DATA)
            self._ids = np.arange(self._n_vocab, dtype=np.int32)
        cur = self._cur
        cur["id"] = self._ids  # the samplers reorder the candidates
        cur["logit"] = logits
        cur["p"] = 0.0
        return _candidates(cur)

    def _pick(self, arr: Any) -> int:
        """Run the draw over the candidates ``arr`` and return the token it selects."""
        _ll.llama_sampler_apply(self._draw, ctypes.byref(arr))
        if not 0 <= arr.selected < arr.size:
            raise RuntimeError("the sampler chain selected no token")
        return int(arr.data[arr.selected].id)

    def allows(self, token: int) -> bool:
        """Whether the grammar (if any) allows ``token`` next."""
        if self._grammar is None:
            return True
        one = self._one
        one["id"], one["logit"], one["p"] = token, 0.0, 0.0
        _ll.llama_sampler_apply(self._grammar, ctypes.byref(_candidates(one)))
        return bool(np.isfinite(one["logit"][0]))

    def accept_grammar(self, token: int) -> None:
        """Advance the grammar over ``token`` (tests walk a text through it); ValueError if
        the grammar does not allow it (llama.cpp would abort the process)."""
        if not self.allows(token):
            raise ValueError(f"the grammar does not allow token {token} here")
        if self._grammar is not None:
            _ll.llama_sampler_accept(self._grammar, token)

    def close(self) -> None:
        self._free()


def _new_chain() -> object:
    params = _ll.llama_sampler_chain_default_params()
    params.no_perf = True
    ptr = _ll.llama_sampler_chain_init(params)
    if not ptr:
        raise LlamaError("llama.cpp could not create a sampler chain")
    return ptr


def _candidates(buf: np.ndarray) -> Any:
    return _ll.llama_token_data_array(
        data=buf.ctypes.data_as(_ll.llama_token_data_p), size=len(buf), selected=-1,
        sorted=False)


def _free_samplers(ptrs: list[object]) -> None:
    for p in ptrs:
        _ll.llama_sampler_free(p)
