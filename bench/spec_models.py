"""What bench.speculative and bench.ceiling measure: the target models (and their draft
models), the three turns they are asked, and what a verification of n tokens costs a
model on this machine."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.servers import ROOT, ModelSpec

MODELS = ROOT / "models"
# the file of the code-edit turns: 65 lines of statecache/pages.py, frozen here so that a
# turn asks the same of every commit, and holding the function the turns rename (an
# edit of a function the file does not hold is not a copy: a small model writes new code)
CODE_FILE = Path(__file__).parent / "texts" / "code_edit.py.txt"


@dataclass(slots=True, frozen=True)
class Target:
    label: str  # its memory kind, for the table
    model: ModelSpec
    draft: Path | None = None  # a draft model for it, if there is one


def _real(which: str) -> Path:
    out = subprocess.run([sys.executable, "-m", "proxy.models", which], cwd=ROOT, check=True,
                         capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def targets(full: bool, quick: bool = False) -> list[Target]:
    def synth(name: str) -> Path:
        subprocess.run([sys.executable, "-m", "tools.synth_gguf", name, "--out", str(MODELS)],
                       cwd=ROOT, check=True, capture_output=True)
        from tools.synth_gguf import path_for
        return path_for(name, MODELS)

    out = [
        Target("hybrid", ModelSpec("spec-target-tiny", synth("spec-target"), False),
               synth("spec-draft")),
        Target("hybrid without rollback (jamba)",
               ModelSpec("spec-jamba-target-tiny", synth("spec-jamba-target"), False),
               synth("spec-jamba-draft")),
        Target("plain attention", ModelSpec("spec-llama-target-tiny", synth("spec-llama-target"),
                                            False), synth("spec-llama-draft")),
        Target("hybrid (mid size)", ModelSpec("hybrid-mid", synth("mid"), False),
               synth("mid-draft")),
        Target("plain attention (SmolLM2-135M)", ModelSpec("smollm2-135m", _real("default"),
                                                           False)),
    ]
    if quick:  # the tiny hybrid and its draft
        return out[:1]
    if full:
        out += [
            Target("SWA (Gemma 3 270M)", ModelSpec("gemma-3-270m", _real("gemma"), True)),
            Target("hybrid (0.8B, bench size)",
                   ModelSpec("hybrid-bench", synth("bench"), False), synth("bench-draft")),
        ]
    return out


def workloads(code_lines: int = 0) -> dict[str, tuple[list[dict[str, str]], int]]:
    """The three turns; ``code_lines``: the code file's first lines only (0: all)."""
    lines = CODE_FILE.read_text().splitlines()
    code = "\n".join(lines[:code_lines] if code_lines else lines)
    earlier = code.replace("as_tokens", "to_token_array")  # the assistant's, two turns back
    return {
        "chat": ([{"role": "user", "content": "Explain in a few paragraphs why a recurrent "
                   "state cannot be rolled back by truncating a cache, and what a "
                   "checkpoint does instead."}], 256),
        "code-edit": ([{"role": "user", "content": "Here is a Python file:\n\n```python\n"
                        + code + "\n```\n\nRewrite the whole file with the function "
                        "as_tokens renamed to to_token_array. Output only the code."}], 256),
        # a file the assistant wrote two turns earlier, asked for again with one change
        "re-emit": ([
            {"role": "user", "content": "Write a Python module of page hashes for a prefix "
             "cache, with a function to_token_array."},
            {"role": "assistant", "content": "```python\n" + earlier + "\n```"},
            {"role": "user", "content": "Thanks. Does it handle lists as well as numpy "
             "arrays?"},
            {"role": "assistant", "content": "Yes: a list is converted with np.asarray and "
             "checked."},
            {"role": "user", "content": "Output the module from your first answer again, "
             "whole, with to_token_array renamed to as_int32_tokens. Output only the code."}],
            256),
    }


def verify_cost(model: Path, n_rs_seq: int, sizes: tuple[int, ...] = (1, 2, 3, 5),
                context: int = 300) -> list[dict[str, Any]]:
    """What a verification costs the target on this machine: one lane holding
    ``context`` tokens decoding n tokens at once (a last token and n - 1 drafts, logits
    for all), median ms of 8, each size in a run of its own (``ms``: llama.cpp reuses the
    graph of the step before), and for n > 1 with steps of one token between
    (``after_one_ms``, and ``one_after_ms`` for those steps of one: every step a graph
    built anew, as where a lane drafts at one step and not at the next)."""
    import numpy as np

    from proxy.engine.binding import Context, ContextParams, Model, init_backend

    init_backend()
    rows = []
    with Model(model) as m, Context(m, ContextParams(n_ctx=4096, n_batch=512, n_ubatch=512,
                                                      n_rs_seq=n_rs_seq)) as ctx:
        ctx.prefill(0, np.arange(context, dtype=np.int32) % 200 + 10, 0)
        pos = context

        def timed(pattern: tuple[int, ...]) -> dict[int, float]:
            """Median ms of each size, decoded in ``pattern`` 11 times over, the first
            three untimed: a decode of a new size builds its graph, which llama.cpp then
            reuses while the size stays (as in a stream's own run of steps)."""
            nonlocal pos
            times: dict[int, list[float]] = {size: [] for size in pattern}
            for i in range(11):
                for size in pattern:
                    ctx.batch.clear()
                    ctx.batch.add(0, list(range(20, 20 + size)), pos, logits_last=True,
                                  logits_from=0)
                    t0 = time.perf_counter()
                    ctx.decode()
                    if i >= 3:
                        times[size].append(time.perf_counter() - t0)
                    if not ctx.seq_rm(0, pos + 1, -1):  # keep one token, as a rejection would
                        raise RuntimeError("seq_rm refused")
                    pos += 1
            return {size: 1000 * statistics.median(t) for size, t in times.items()}

        for n in sizes:
            row = {"model": model.name, "tokens": n, "context": context, "ms": timed((n,))[n]}
            if n > 1:
                both = timed((1, n))
                row["after_one_ms"], row["one_after_ms"] = both[n], both[1]
            rows.append(row)
    return rows


def picked(only: str, label: str) -> bool:
    """Whether ``--only`` picks a target: its label holds any comma-separated part."""
    return any(part in label for part in only.split(","))
