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
import json
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from proxy.engine.binding import Context, ContextParams, Model
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


class Greedy:
    """One model and one context (one lane) through the binding, proxy/engine/binding."""

    def __init__(self, path: Path, n_ctx: int = 2048, threads: int = 1) -> None:
        self.model = Model(path)
        try:
            self.ctx = Context(self.model, ContextParams(n_ctx=n_ctx, n_batch=512,
                                                         n_ubatch=512, threads=threads))
        except Exception:
            self.model.close()
            raise
        self.n_vocab = self.model.n_vocab
        self._pos = 0  # tokens in the lane

    def close(self) -> None:
        self.ctx.close()
        self.model.close()

    def tokens(self) -> list[str]:
        """Every token's text (special tokens rendered)."""
        return [self.model.token_bytes(t).decode("utf-8", "replace")
                for t in range(self.n_vocab)]

    def tokenize(self, text: str, special: bool) -> list[int]:
        return self.model.tokenize(text, add_special=False, parse_special=special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.model.detokenize(ids, special=False)

    def reset(self) -> None:
        self.ctx.clear_all()
        self._pos = 0

    def decode(self, ids: Sequence[int]) -> int:
        """Decode ``ids`` after what is already there; return the argmax of the last logits."""
        logits = self.ctx.prefill(0, ids, self._pos)
        if logits is None:
            raise ValueError("nothing to decode")
        self._pos += len(ids)
        return int(np.argmax(logits))


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
