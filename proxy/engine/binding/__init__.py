"""Typed access to llama.cpp through llama-cpp-python's low-level API.

This package is the only part of the project that imports ``llama_cpp``. Everything
above it talks in Python ints, numpy arrays and memoryviews. One module each: the
backend (log, flags, errors, fingerprints), a model and its vocabulary, a context
(lanes, batches, decode, state), its memory's description, the sampler chain and
grammar.
"""

from __future__ import annotations

import llama_cpp as _ll  # noqa: F401  (bench.gap times llama_decode through it)

from proxy.engine.binding.backend import (
    FLAGS_FULL,
    FLAGS_PARTIAL,
    LLAMA_CPP_VERSION,
    LlamaError,
    UnencodableText,
    fingerprint_file,
    gpu_offload,
    init_backend,
)
from proxy.engine.binding.context import (
    Batch,
    Context,
    ContextParams,
    StateBuffer,
    supports_rs_rollback,
)
from proxy.engine.binding.memory import MemoryInfo, MemoryKind
from proxy.engine.binding.model import Model
from proxy.engine.binding.sampler import (
    MAX_GRAMMAR_NESTING,
    SamplerChain,
    SchemaRules,
    check_grammar,
)

__all__ = [
    "FLAGS_FULL", "FLAGS_PARTIAL", "LLAMA_CPP_VERSION", "MAX_GRAMMAR_NESTING", "Batch",
    "Context", "ContextParams", "LlamaError", "MemoryInfo", "MemoryKind", "Model",
    "SamplerChain", "SchemaRules", "StateBuffer", "UnencodableText", "check_grammar",
    "fingerprint_file", "gpu_offload", "init_backend", "supports_rs_rollback",
]
