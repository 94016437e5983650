"""llama.cpp's sampler chain and grammar: the checks of a GBNF text, JSON-schema rules,
and a chain that samples a row of logits."""

from __future__ import annotations

import ctypes
import math
import weakref
from collections.abc import Sequence
from typing import Any

import llama_cpp as _ll
import numpy as np

from proxy.engine.binding.backend import LlamaError
from proxy.engine.binding.context import Context
from proxy.engine.binding.model import Model

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
        return self.sample_logits(ctx.logits_view(row))

    def sample_logits(self, logits: np.ndarray) -> int:
        """Sample and accept the next token from a row of logits kept apart (a
        checkpoint's): what ``sample`` does with a row of the context's, step for step
        as ``llama_sampler_sample`` does it (candidates in token order, the chain, the
        selected token accepted)."""
        if self._grammar is None:
            arr = self._fill(logits)
            _ll.llama_sampler_apply(self._chain, ctypes.byref(arr))
            if not 0 <= arr.selected < arr.size:
                raise RuntimeError("the sampler chain selected no token")
            tok = int(arr.data[arr.selected].id)
            _ll.llama_sampler_accept(self._chain, tok)
            return tok
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

    def take(self, token: int) -> None:
        """Accept a token this chain did not choose (a forced one) as if it had: the
        grammar (which must allow it), the penalties and the draw all see it."""
        if self._grammar is not None:
            _ll.llama_sampler_accept(self._grammar, token)
        for chain in {id(c): c for c in (self._mods, self._chain, self._draw)}.values():
            _ll.llama_sampler_accept(chain, token)

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
