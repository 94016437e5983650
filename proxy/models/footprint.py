"""A model's memory from its GGUF header: its kind (attention, SWA, hybrid, recurrent) and
the bytes llama.cpp's sequence state takes, per token of attention KV and per lane of
recurrent state, without loading it.

The rules follow llama.cpp's own (the build of llama-cpp-python 0.3.36), written out in
docs/models.md: which layers are recurrent or sliding-window per architecture, K and V
rows of f16, a cell's position record (12 bytes, 24 with M-RoPE's 2-D position), the
Mamba / Gated DeltaNet / short-convolution / RWKV state rows of f32. On every model the
tests have (llama, qwen35, jamba, Gemma 3's SWA) the per-token figure equals the one the
engine measures on the loaded model (``Context.describe_memory``) byte for byte, and the
recurrent one is within its few hundred bytes of record headers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proxy.models.header import Header

# llama.cpp's llm_arch_is_recurrent: every layer recurrent, no attention
RECURRENT_ARCHS = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})
# llm_arch_is_hybrid: recurrent layers beside attention
HYBRID_ARCHS = frozenset({
    "jamba", "falcon-h1", "plamo2", "granitehybrid", "lfm2", "lfm2moe", "nemotron_h",
    "nemotron_h_moe", "qwen3next", "kimi-linear", "bailingmoe3", "kimi-k3", "glm5-next",
    "qwen35", "qwen35moe", "qwen4exp", "deepseek4", "minimax-01"})
# hybrids whose recurrent layers are all but every Nth ({arch}.full_attention_interval)
_INTERVAL_ARCHS = frozenset({"qwen3next", "qwen35", "qwen35moe", "qwen4exp", "minimax-01"})
# the default sliding-window pattern where the header names none: (N, dense first);
# N: every Nth layer is full attention (the last of each N, or the first if dense first)
SWA_PATTERNS: dict[str, tuple[int, bool]] = {
    "gemma2": (2, False), "gemma3": (6, False), "gemma3n": (5, False),
    "gemma-embedding": (6, False), "cohere2": (4, False), "cohere2moe": (4, True),
    "llama4": (4, False), "olmo2": (4, False), "exaone4": (4, False), "exaone-moe": (4, False),
    "openai-moe": (2, False), "afmoe": (4, False), "smallthinker": (4, True),
    "plamo3": (8, False), "mellum": (4, False), "laguna": (4, True), "muse-glimmer": (4, False),
}
# M-RoPE (a 2-D position per cell, 12 more bytes of cell record in a state)
MROPE_ARCHS = frozenset({"qwen2vl", "paddleocr", "qwen3vl", "qwen3vlmoe", "qwen35",
                         "qwen35moe", "qwen4exp", "qwen3tts"})
KV_ELEMENT = 2  # f16 K and V (the engine's contexts: statecache's state format says kv=f16)
STATE_ELEMENT = 4  # f32 recurrent rows
CELL_RECORD = 12  # a KV cell in a sequence state: position, seq-id count, the seq id
CELL_EXT = 12  # M-RoPE's (x, y) and the cell's token


@dataclass(slots=True, frozen=True)
class Footprint:
    architecture: str
    kind: str  # "attention", "swa", "hybrid", "recurrent"
    n_layer: int
    attention_layers: int
    swa_layers: int
    recurrent_layers: int
    n_swa: int  # the sliding window, 0 without one
    training_context: int
    full_bytes_per_token: int  # K and V rows of the full-attention layers
    swa_bytes_per_token: int  # of the sliding-window layers
    record_bytes: int  # a cell's record, per KV cache a token sits in
    recurrent_bytes: int  # a lane's recurrent state: what a partial checkpoint holds

    @property
    def kv_bytes_per_token(self) -> int:
        """What one more token adds to a sequence state while it is inside the window:
        the engine's ``bytes_per_token``, which sizes ``model.kv_budget``. With a window,
        llama.cpp keeps two caches (full and sliding), each with the token's record."""
        if not self.attention_layers:
            return 0
        caches = 2 if self.swa_bytes_per_token else 1
        return self.full_bytes_per_token + self.swa_bytes_per_token + caches * self.record_bytes

    def kv_bytes(self, n_tokens: int) -> int:
        """The attention KV of a sequence of ``n_tokens``: a sliding-window layer keeps
        only the window's cells."""
        if not self.attention_layers:
            return 0
        full = (self.full_bytes_per_token + self.record_bytes) * n_tokens
        if not self.swa_bytes_per_token:
            return full
        return full + (self.swa_bytes_per_token + self.record_bytes) * min(n_tokens, self.n_swa)

    def conversation_bytes(self, n_tokens: int) -> int:
        """A conversation of ``n_tokens`` kept warm: its KV once (the pool keeps pages
        once) and the recurrent state of the point it resumes from."""
        return self.kv_bytes(n_tokens) + self.recurrent_bytes


def footprint(h: Header) -> Footprint:
    """The memory of the model whose header is ``h``; ValueError when the header lacks
    what that takes (a file without an architecture or a layer count)."""
    arch = h.architecture
    if not arch:
        raise ValueError("no general.architecture in the header")
    n_layer = _int(h.arch_value("block_count"))
    if n_layer <= 0:
        raise ValueError(f"no {arch}.block_count in the header")
    n_embd = _int(h.arch_value("embedding_length"))
    n_head = _per_layer(h.arch_value("attention.head_count", 0), n_layer)
    n_head_kv = _per_layer(h.arch_value("attention.head_count_kv", n_head), n_layer)
    recurrent = _recurrent_layers(h, arch, n_layer, n_head_kv)
    swa = _swa_layers(h, arch, n_layer, recurrent)
    n_swa = _int(h.arch_value("attention.sliding_window")) if any(swa) else 0
    full_bytes = swa_bytes = n_attn = 0
    for il in range(n_layer):
        if n_head_kv[il] <= 0 or (recurrent[il] and arch != "falcon-h1"):
            continue  # no KV cache for this layer
        n_attn += 1
        head_k, head_v = _head_dims(h, n_embd, n_head[il], swa[il])
        row = n_head_kv[il] * (head_k + head_v) * KV_ELEMENT
        if swa[il]:
            swa_bytes += row
        else:
            full_bytes += row
    n_rec = sum(recurrent)
    return Footprint(
        architecture=arch,
        kind=("recurrent" if n_rec and not n_attn else "hybrid" if n_rec else
              "swa" if swa_bytes else "attention"),
        n_layer=n_layer, attention_layers=n_attn, swa_layers=sum(swa), recurrent_layers=n_rec,
        n_swa=n_swa, training_context=_int(h.arch_value("context_length")),
        full_bytes_per_token=full_bytes, swa_bytes_per_token=swa_bytes,
        record_bytes=CELL_RECORD + (CELL_EXT if arch in MROPE_ARCHS else 0),
        recurrent_bytes=n_rec * (_state_r(h, n_embd) + _state_s(h, n_embd)) * STATE_ELEMENT)


def _int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def _per_layer(v: Any, n_layer: int) -> list[int]:
    """A per-layer value: one number for every layer, or an array of them."""
    if isinstance(v, list) and len(v) >= n_layer:
        return [_int(x) for x in v[:n_layer]]
    if isinstance(v, list):
        raise ValueError(f"a per-layer array of {len(v)} values for {n_layer} layers")
    return [_int(v)] * n_layer


def _recurrent_layers(h: Header, arch: str, n_layer: int, n_head_kv: list[int]) -> list[bool]:
    if arch in RECURRENT_ARCHS:
        return [True] * n_layer
    explicit = h.arch_value("attention.recurrent_layers")
    if isinstance(explicit, list) and len(explicit) >= n_layer:
        return [bool(x) for x in explicit[:n_layer]]
    if arch not in HYBRID_ARCHS:
        return [False] * n_layer
    if arch == "falcon-h1":  # Mamba beside attention in every layer
        return [True] * n_layer
    if arch in _INTERVAL_ARCHS:
        every = _int(h.arch_value("full_attention_interval")) or 4
        return [(il + 1) % every != 0 for il in range(n_layer)]
    if arch.startswith("nemotron_h"):  # Mamba layers have neither attention nor an FFN
        n_ff = _per_layer(h.arch_value("feed_forward_length", 0), n_layer)
        return [n_head_kv[il] == 0 and n_ff[il] == 0 for il in range(n_layer)]
    return [n == 0 for n in n_head_kv]


def _swa_layers(h: Header, arch: str, n_layer: int, recurrent: list[bool]) -> list[bool]:
    if _int(h.arch_value("attention.sliding_window")) <= 0:
        return [False] * n_layer
    pattern = h.arch_value("attention.sliding_window_pattern")
    if isinstance(pattern, list) and len(pattern) >= n_layer:
        return [bool(x) for x in pattern[:n_layer]]
    if arch.startswith("lfm2"):  # its attention layers are the sliding-window ones
        return [not r for r in recurrent]
    if arch not in SWA_PATTERNS and not isinstance(pattern, int):
        return [False] * n_layer  # an architecture llama.cpp gives no window
    every, dense_first = SWA_PATTERNS.get(arch, (0, False))
    every = pattern if isinstance(pattern, int) and not isinstance(pattern, bool) else every
    if dense_first:
        return [every == 0 or il % every != 0 for il in range(n_layer)]
    return [every == 0 or il % every < every - 1 for il in range(n_layer)]


def _head_dims(h: Header, n_embd: int, n_head: int, swa: bool) -> tuple[int, int]:
    default = n_embd // n_head if n_head else 0
    k = _int(h.arch_value("attention.key_length")) or default
    v = _int(h.arch_value("attention.value_length")) or default
    if swa:
        k = _int(h.arch_value("attention.key_length_swa")) or k
        v = _int(h.arch_value("attention.value_length_swa")) or v
    return k, v


def _state_r(h: Header, n_embd: int) -> int:
    """A recurrent layer's convolution (or token-shift) row: llama_hparams::n_embd_r."""
    if _int(h.arch_value("wkv.head_size")):  # RWKV
        return (_int(h.arch_value("token_shift_count")) or 2) * n_embd
    l_cache = _int(h.arch_value("shortconv.l_cache"))
    if l_cache:  # LFM2's short convolutions
        return n_embd * (l_cache - 1)
    d_conv = _int(h.arch_value("ssm.conv_kernel"))
    return max(d_conv - 1, 0) * (_int(h.arch_value("ssm.inner_size"))
                                 + 2 * _int(h.arch_value("ssm.group_count"))
                                 * _int(h.arch_value("ssm.state_size")))


def _state_s(h: Header, n_embd: int) -> int:
    """A recurrent layer's state row: llama_hparams::n_embd_s."""
    head = _int(h.arch_value("wkv.head_size"))
    if head:
        return n_embd * head
    return _int(h.arch_value("ssm.state_size")) * _int(h.arch_value("ssm.inner_size"))
