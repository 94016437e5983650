"""A context over a model: lanes (sequences), batches, decode, logits, state save and
restore, and the ggml threadpool its decodes run on (threadpool.py)."""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass

import llama_cpp as _ll
import numpy as np

from proxy.engine.binding.backend import FLAGS_FULL, FLAGS_PARTIAL, LlamaError, log
from proxy.engine.binding.memory import MemoryInfo, MemoryKind
from proxy.engine.binding.model import Model
from proxy.engine.binding.threadpool import ThreadpoolParams, threadpool_api


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
    # flash attention: -1 auto (on where the backend has it), 0 off (V stored
    # transposed), 1 on; KV cache types as ggml type ids (1 = f16, 8 = q8_0)
    flash_attn: int = -1
    type_k: int = 1
    type_v: int = 1


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
        p.flash_attn_type = params.flash_attn
        p.type_k = params.type_k
        p.type_v = params.type_v
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
        self._pool_api = threadpool_api() if params.poll >= 0 and threads > 1 else None
        if self._pool_api is not None:
            cpu, llama = self._pool_api
            tp = ThreadpoolParams()
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

    def save_into(self, lane: int, dst: mmap.mmap, flags: int = FLAGS_FULL) -> None:
        """Serialise one lane into ``dst`` (a map of at least ``state_size`` bytes that
        the caller keeps), cut to the bytes written."""
        size = len(dst)
        arr = (ctypes.c_uint8 * size).from_buffer(dst)
        try:
            n = int(_ll.llama_state_seq_get_data_ext(self._ptr, arr, size, lane, flags))
        finally:
            del arr  # its view of ``dst`` goes with it
        if n == 0 and size != 0:
            raise LlamaError(f"saving lane {lane} failed")
        if n != size:
            dst.resize(n)

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
            swa_window=kind is MemoryKind.SWA and not self.params.swa_full,
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
