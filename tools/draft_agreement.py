"""How often a draft model's greedy choice agrees with its target's.

    python -m tools.draft_agreement [--pair spec-target|spec-llama-target|
                                    spec-jamba-target|mid|bench] [--tokens 64]
                                    [--prompts 4] [--k 4] [--scale S] [--json]
    python -m tools.draft_agreement --target T.gguf --draft D.gguf

The target decodes greedily from each prompt (ChatML chat turns); the draft
walks the same tokens in lockstep, so at every position both see the same
prefix. Reported:

- ``agreement``: fraction of positions where the draft's argmax is the
  target's argmax;
- ``acceptance`` for draft length k: greedy speculative decoding simulated on
  those positions. A round starting at position i drafts k tokens greedily;
  while the draft agrees with the target its prefix *is* the target's, so the
  draft's j-th token is the lockstep argmax at i+j and the accepted length is
  the run of agreements from i, capped at k. The target then emits one token
  of its own (the correction, or the bonus after k accepted), so the next round
  starts at i + accepted + 1. ``acceptance`` = accepted / drafted,
  ``mean_accepted`` = accepted per round, ``tokens_per_verify`` = tokens
  emitted per target batch (accepted + 1);
- ``size_ratio``: draft file size / target file size;
- ``draft_round_trips``: the draft's own greedy text re-tokenizes to the same
  ids and holds only normal (single-character) tokens.

``--scale`` writes the pair with another damping scale into a temporary folder
(how the scales in tools/synth_gguf.py DRAFTS were chosen).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from tools import synth_gguf

SYSTEM = "You are a helpful assistant."
# Typical chat turns: a question, a coding request, a rewrite, a short chat.
QUESTIONS = (
    "What is the capital of France, and why did it become the capital?",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Rewrite this sentence to be more formal: gonna grab food, back in 10 mins.",
    "Hi! Can you tell me a short story about a robot who learns to paint?",
    "Explain the difference between a list and a tuple in Python.",
    "Summarise the plot of Hamlet in three sentences.",
)


def chat_prompt(question: str) -> str:
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
            "<|im_start|>assistant\n")


_SILENT: Any = None  # llama.cpp's log callback, referenced for as long as it may be called


def _llama() -> Any:
    import llama_cpp

    global _SILENT
    if _SILENT is None:
        llama_cpp.llama_backend_init()
        _SILENT = llama_cpp.llama_log_callback(lambda level, text, data: None)
        llama_cpp.llama_log_set(_SILENT, None)
    return llama_cpp


class Greedy:
    """One model and one context through llama-cpp-python's low-level API."""

    def __init__(self, path: Path, n_ctx: int = 2048, threads: int = 1) -> None:
        lc = self.lc = _llama()
        self.model = lc.llama_model_load_from_file(str(path).encode(),
                                                   lc.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"cannot load {path}")
        self.vocab = lc.llama_model_get_vocab(self.model)
        self.n_vocab = int(lc.llama_vocab_n_tokens(self.vocab))
        cp = lc.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = cp.n_ubatch = 512
        cp.n_threads = cp.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, cp)
        if not self.ctx:
            lc.llama_model_free(self.model)
            raise RuntimeError(f"cannot create a context for {path}")

    def close(self) -> None:
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)

    def tokens(self) -> list[str]:
        """Every token's text (special tokens rendered)."""
        out = []
        buf = ctypes.create_string_buffer(64)
        for t in range(self.n_vocab):
            n = self.lc.llama_token_to_piece(self.vocab, t, buf, len(buf), 0, True)
            out.append(buf.raw[: max(n, 0)].decode("utf-8", "replace"))
        return out

    def tokenize(self, text: str, special: bool) -> list[int]:
        data = text.encode()
        buf = (self.lc.llama_token * (len(data) + 8))()
        n = self.lc.llama_tokenize(self.vocab, data, len(data), buf, len(buf), False, special)
        if n < 0:
            raise ValueError("tokenize failed")
        return list(buf[:n])

    def detokenize(self, ids: Sequence[int]) -> str:
        arr = (self.lc.llama_token * len(ids))(*ids)
        buf = ctypes.create_string_buffer(len(ids) * 8 + 16)
        n = self.lc.llama_detokenize(self.vocab, arr, len(ids), buf, len(buf), False, False)
        if n < 0:
            raise ValueError("detokenize failed")
        return buf.raw[:n].decode("utf-8")

    def reset(self) -> None:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)

    def decode(self, ids: Sequence[int]) -> int:
        """Decode ``ids`` after what is already there; return the argmax of the last logits."""
        for i in range(0, len(ids), 512):
            chunk = ids[i : i + 512]
            arr = (self.lc.llama_token * len(chunk))(*chunk)
            rc = self.lc.llama_decode(self.ctx, self.lc.llama_batch_get_one(arr, len(chunk)))
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
        ptr = self.lc.llama_get_logits_ith(self.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))))


@contextmanager
def loaded(path: Path, **kw: int) -> Iterator[Greedy]:
    m = Greedy(path, **kw)
    try:
        yield m
    finally:
        m.close()


def lockstep(target: Greedy, draft: Greedy, prompt: str, n: int) -> tuple[list[int], list[bool]]:
    """The target's ``n`` greedy tokens after ``prompt`` and, at each, whether
    the draft (fed the same tokens) would have chosen it."""
    target.reset()
    draft.reset()
    ids = target.tokenize(prompt, special=True)
    t, d = target.decode(ids), draft.decode(ids)
    out, agree = [], []
    for _ in range(n):
        out.append(t)
        agree.append(t == d)
        t, d = target.decode([t]), draft.decode([t])
    return out, agree


def simulate(agree: Sequence[bool], k: int) -> tuple[int, int, int]:
    """Greedy speculative decoding over lockstep agreements: (rounds, drafted,
    accepted), full rounds only (see the module docstring)."""
    rounds = accepted = 0
    i = 0
    while i + k <= len(agree):
        a = 0
        while a < k and agree[i + a]:
            a += 1
        rounds += 1
        accepted += a
        i += a + 1
    return rounds, rounds * k, accepted


@dataclass
class Report:
    target: str
    draft: str
    prompts: int
    tokens: int  # target tokens per prompt
    k: int
    agreement: float
    acceptance: float
    mean_accepted: float
    tokens_per_verify: float
    size_ratio: float
    target_mb: float
    draft_mb: float
    same_vocab: bool
    draft_round_trips: bool
    per_prompt_agreement: list[float]

    def lines(self) -> str:
        return "\n".join([
            f"target {self.target} ({self.target_mb:.1f} MB), draft {self.draft} "
            f"({self.draft_mb:.1f} MB): size ratio {self.size_ratio:.3f}",
            f"{self.prompts} prompts x {self.tokens} greedy tokens: agreement "
            f"{self.agreement:.3f} (per prompt "
            + ", ".join(f"{a:.2f}" for a in self.per_prompt_agreement) + ")",
            f"k={self.k}: acceptance {self.acceptance:.3f}, mean accepted "
            f"{self.mean_accepted:.2f}/round, {self.tokens_per_verify:.2f} tokens per target batch",
            f"same vocabulary: {self.same_vocab}, draft text round-trips: "
            f"{self.draft_round_trips}",
        ])


def round_trips(model: Greedy, prompt: str, n: int) -> bool:
    model.reset()
    tok = model.decode(model.tokenize(prompt, special=True))
    out = []
    for _ in range(n):
        out.append(tok)
        tok = model.decode([tok])
    normal = all(synth_gguf.VOCAB.types[t] == 1 for t in out)
    return normal and model.tokenize(model.detokenize(out), special=False) == out


def measure(target_path: Path, draft_path: Path, *, prompts: int = 4, tokens: int = 64,
            k: int = 4, threads: int = 1) -> Report:
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(prompts)]
    n_ctx = 256 + tokens + max(len(chat_prompt(q)) for q in questions)
    with loaded(target_path, n_ctx=n_ctx, threads=threads) as target, \
            loaded(draft_path, n_ctx=n_ctx, threads=threads) as draft:
        same_vocab = target.tokens() == draft.tokens()
        agree_all: list[bool] = []
        per_prompt: list[float] = []
        rounds = drafted = accepted = 0
        for q in questions:
            _, agree = lockstep(target, draft, chat_prompt(q), tokens)
            agree_all += agree
            per_prompt.append(float(np.mean(agree)))
            r, dr, ac = simulate(agree, k)
            rounds, drafted, accepted = rounds + r, drafted + dr, accepted + ac
        trips = round_trips(draft, chat_prompt(questions[0]), tokens)
    t_size, d_size = target_path.stat().st_size, draft_path.stat().st_size
    return Report(
        target=target_path.name, draft=draft_path.name, prompts=prompts, tokens=tokens, k=k,
        agreement=float(np.mean(agree_all)),
        acceptance=accepted / max(drafted, 1),
        mean_accepted=accepted / max(rounds, 1),
        tokens_per_verify=(accepted + rounds) / max(rounds, 1),
        size_ratio=d_size / t_size, target_mb=t_size / 1e6, draft_mb=d_size / 1e6,
        same_vocab=same_vocab, draft_round_trips=trips, per_prompt_agreement=per_prompt,
    )


def pair_paths(pair: str, out_dir: Path, scale: float | None = None) -> tuple[Path, Path]:
    """The pair's files: from ``out_dir`` (generated if missing), or written
    there afresh with another damping ``scale``."""
    p = synth_gguf.DRAFTS[pair]
    if scale is None:
        return synth_gguf.ensure(p.target, out_dir), synth_gguf.ensure(p.draft, out_dir)
    damping = replace(p.damping, scale=scale)
    return (synth_gguf.generate(p.target, out_dir, p.target_spec(damping)),
            synth_gguf.generate(p.draft, out_dir, p.draft_spec(damping)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.draft_agreement",
                                 description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--pair", choices=sorted(synth_gguf.DRAFTS), default="spec-target")
    ap.add_argument("--models", type=Path, default=Path("models"))
    ap.add_argument("--target", type=Path, help="a target GGUF (with --draft; overrides --pair)")
    ap.add_argument("--draft", type=Path)
    ap.add_argument("--scale", type=float, nargs="*",
                    help="damping scales to try (pair written to a temporary folder)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1,
                    help="1 by default: spinning threads crawl on a busy machine")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    kw = dict(prompts=args.prompts, tokens=args.tokens, k=args.k, threads=args.threads)

    def show(report: Report, label: str = "") -> None:
        if args.json:
            print(json.dumps({"label": label, **asdict(report)}))
        else:
            print((f"[{label}] " if label else "") + report.lines().replace("\n", "\n  "))

    if args.target or args.draft:
        if not (args.target and args.draft):
            ap.error("--target and --draft go together")
        show(measure(args.target, args.draft, **kw))
    elif args.scale:
        with tempfile.TemporaryDirectory(prefix="draft-agreement-") as tmp:
            for scale in args.scale:
                show(measure(*pair_paths(args.pair, Path(tmp), scale), **kw), f"scale {scale:g}")
    else:
        show(measure(*pair_paths(args.pair, args.models), **kw),
             f"{args.pair}, scale {synth_gguf.DRAFTS[args.pair].damping.scale:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
