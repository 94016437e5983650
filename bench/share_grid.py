"""A hybrid's share points on the step grid: the prefill steps it saves and the reuse it
gives up, on the agents' recorded requests.

A hybrid cannot cut its live state back, so each FULL checkpoint of a first turn (its
end, the share points at its message and part starts: proxy/engine/publishing.py) is
saved as the prefill passes it, and one that falls inside a step ends that step early:
a step more than llama-server's. Moved down to the end of the step it falls in
(``cache.share_grid_tokens``: those at most that many tokens past it), it costs no step,
and a new conversation that parts there prefills those tokens again.

Each fixture's requests are rendered and tokenized as the server does (its template and
vocabulary; ``--model`` for another GGUF's, the hybrid's say). The first turn is planned
as a cold hybrid prefill with the server's rules (``publishing.Publisher.points``: the
first turn's end, the share points chosen by ``planner.choose_share_points``, the replay
point and the prompt's end); each later request that starts another conversation
("new session") reuses the deepest of that turn's FULL points within the prefix it
shares with it. Nothing is timed: steps and tokens are counted.

    python -m bench.share_grid                     # 0, a page, 128 and 512 tokens
    python -m bench.share_grid --within 0,64 --model models/hybrid-tiny.gguf
"""

from __future__ import annotations

import argparse
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.replay import FIXTURES, STATECACHE_CONFIG, generates, kinds
from proxy.api.anthropic import parse_messages_request
from proxy.api.chat import ChatRequest
from proxy.api.openai import parse_chat_request
from proxy.api.prompt import Prompt, chat_prompt
from proxy.api.render import ChatTemplate, load_chat_template
from proxy.api.responses import chat_request, parse_responses_request
from proxy.api.volatile import Volatile
from proxy.engine.binding import Model
from proxy.engine.layout import onto_grid, periodic_points, step_ends
from proxy.engine.planner import choose_share_points
from proxy.engine.tokens import Tokenizer
from proxy.meters import EngineMeter
from proxy.models import default_model_path, gemma_model_path
from statecache.config import Config, VolatileRule, load_config
from tools.recorder import read_records


@dataclass(slots=True, frozen=True)
class Row:
    fixture: str
    within: int
    prompt: int  # the first turn's tokens
    steps: int  # its cold prefill's steps on a hybrid
    peer_steps: int  # llama-server's: ceil(prompt / ubatch)
    moved: int  # FULL points moved onto the grid (or dropped)
    reused: int  # tokens the new sessions reuse from the first turn's FULL points
    given_up: int  # of those, what moving gave up


def parse(record: dict[str, Any]) -> ChatRequest | None:
    """A recorded request that generates, parsed as the server parses it."""
    p, body = str(record["path"]), record["body"]
    if p.startswith("/v1/messages"):
        return parse_messages_request(body, hosted_tools="ignore")
    if p.startswith("/v1/responses"):
        return chat_request(parse_responses_request(body, hosted_tools="ignore"), ())
    if p.startswith("/v1/chat/completions"):
        return parse_chat_request(body)
    return None


def prompts(path: Path, tok: Tokenizer, tpl: ChatTemplate, volatile: Volatile
            ) -> Iterator[tuple[str, Prompt]]:
    """Each generating request of a fixture with its kind (bench.replay.kinds)."""
    records = read_records(path)
    for r, kind in zip(records, kinds(records), strict=True):
        if kind in ("other", "retry") or not generates(str(r["path"])):
            continue
        req = parse(r)
        if req is not None:
            yield kind, chat_prompt(tok, tpl, volatile.apply(req), "", 1 << 20)


def first_turn_points(first: Prompt, eog: np.ndarray, cfg: Config, within: int
                      ) -> tuple[list[int], list[int], int]:
    """The cold first turn's FULL points and all its cuts (as Publisher.points places
    them on a hybrid, ``within`` as cache.share_grid_tokens), and the points moved."""
    page, chunk = cfg.cache.page_size, step_chunk(cfg)
    end = len(first.tokens)
    limit = end - 1
    kept = [(first.history or limit) // page * page, end]  # the replay point, the end
    kept += [n for n, _ in first.breakpoints if 0 < n < end]
    hits = np.flatnonzero(np.isin(first.tokens[:limit], eog))
    at = (int(hits[0]) + 1) // page * page if hits.size else 0
    full = [at] if at >= 2 * page else []
    cands = sorted({n for n in first.share_points if 2 * page <= n <= limit})
    full += choose_share_points(cands, [0, *full, *kept[2:]], k=cfg.cache.share_points,
                                page=page)
    moved = onto_grid(full, kept, reuse=0, chunk=chunk, within=within) if within else {}
    full = sorted({moved.get(n, n) for n in full} - {0})
    cuts = sorted({*full, *kept})
    # the periodic points inside the first turn are FULL too (on the grid: no cut)
    every = cfg.cache.periodic_pages * page
    full += [n for n in periodic_points(cuts, reuse=0, limit=limit, every=every,
                                        chunk=chunk) if n <= at and n not in full]
    return sorted(full), cuts, len(moved)


def step_chunk(cfg: Config) -> int:
    """Prompt tokens per step (Publisher.chunk)."""
    step = cfg.engine.step_tokens or cfg.model.n_batch
    return min(cfg.engine.prefill_chunk or step, step)


def measure(path: Path, model: Model, cfg: Config, withins: list[int], volatile: Volatile
            ) -> list[Row]:
    tok = Tokenizer(model, EngineMeter(), None)
    bos = model.token_text(model.bos) if model.bos >= 0 else ""
    eos = model.token_text(model.eos) if model.eos >= 0 else ""
    tpl = load_chat_template(model.chat_template(), bos_token=bos, eos_token=eos)
    eog = np.array([t for t in range(model.n_vocab) if model.is_eog(t)], dtype=np.int32)
    got = list(prompts(path, tok, tpl, volatile))
    firsts = [p for kind, p in got if kind == "cold"]
    if not firsts:
        return []
    first = firsts[0]
    news = [p for kind, p in got if kind == "new session"]
    name = path.name.removesuffix(".jsonl.zst")
    rows: list[Row] = []
    base: int | None = None
    for within in withins:
        full, cuts, moved = first_turn_points(first, eog, cfg, within)
        reused = 0
        for p in news:
            n = min(len(p.tokens), len(first.tokens))
            diff = np.flatnonzero(p.tokens[:n] != first.tokens[:n])
            common = min(int(diff[0]) if diff.size else n, len(p.tokens) - 1)
            reused += max((f for f in full if f <= common), default=0)
        base = reused if base is None else base
        steps = len(step_ends(cuts, reuse=0, end=len(first.tokens), chunk=step_chunk(cfg)))
        rows.append(Row(name, within, len(first.tokens), steps,
                        -(-len(first.tokens) // cfg.model.n_ubatch), moved, reused,
                        base - reused))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.share_grid", description=__doc__.split("\n")[0])
    ap.add_argument("--fixtures", type=Path, default=FIXTURES)
    ap.add_argument("--within", default="0,32,128,512",
                    help="comma-separated cache.share_grid_tokens to compare (0: off)")
    ap.add_argument("--model", type=Path, help="every fixture on this GGUF")
    a = ap.parse_args(argv)
    withins = [int(w) for w in a.within.split(",")]
    if withins[0] != 0:
        withins.insert(0, 0)  # what is given up is counted against the points unmoved
    cfg = load_config(None, {})
    rules = [VolatileRule(**r) for r in tomllib.loads(STATECACHE_CONFIG)["server"]["volatile"]]
    print("| fixture | share_grid_tokens | first turn tokens | hybrid steps | llama-server "
          "ubatches | points moved | new sessions reuse | reuse given up |")
    print("|---|---|---|---|---|---|---|---|")
    for path in sorted(a.fixtures.glob("*.jsonl.zst")):
        gguf = a.model or (gemma_model_path() if "gemma3" in path.name
                           else default_model_path())
        model = Model(gguf)
        try:
            for r in measure(path, model, cfg, withins, Volatile(rules)):
                print(f"| {r.fixture} | {r.within} | {r.prompt:,} | {r.steps} | "
                      f"{r.peer_steps} | {r.moved} | {r.reused:,} | {r.given_up:,} |",
                      flush=True)
        finally:
            model.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
