"""A loaded model: its metadata, vocabulary, tokenizer and pieces."""

from __future__ import annotations

import ctypes
import dataclasses
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import llama_cpp as _ll
import numpy as np

from proxy.engine.binding.backend import (
    LlamaError,
    UnencodableText,
    fingerprint_file,
    init_backend,
)
from proxy.engine.binding.vocab import VocabFacts, other_facts, spm_facts


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
        lstrip = False
        for t in range(self.n_vocab):
            texts.append(_ll.llama_vocab_get_text(self._vocab, t) or b"")
            attr = _ll.llama_vocab_get_attr(self._vocab, t)
            special.append(bool(attr & special_attrs))
            lstrip = lstrip or bool(attr & _ll.LLAMA_TOKEN_ATTR_LSTRIP)
        kind = int(_ll.llama_vocab_type(self._vocab))
        if kind == _ll.LLAMA_VOCAB_TYPE_SPM:
            facts = spm_facts(texts, special)
        else:
            # BPE falls back to byte tokens without throwing; other kinds have an unknown
            # token that may cover any run of text, so no length bound holds for them.
            facts = other_facts(texts, special, bounded=kind == _ll.LLAMA_VOCAB_TYPE_BPE)
        return dataclasses.replace(facts, lstrip=lstrip)

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
