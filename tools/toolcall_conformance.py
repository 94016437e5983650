"""canitoolcall's fixtures (469 recorded model outputs in 9 families) through our
parsers, with every chunking strategy it has.

    python -m tools.toolcall_conformance [--family SLUG] [--show-failures]

Each fixture's model is mapped to a vendored chat template of its family, and the
template is probed for its syntax as a server does at load (a model without a vendored
template gets its family's syntax by name). The fixture's generation prompt says whether
the reply starts inside reasoning. The replay and the checks are canitoolcall's own
(``canitoolcall.adapters.worker.replay``, ``canitoolcall.runner.evaluate``).

Token ids: canitoolcall groups a reply's token ids, but the fixtures' tokenizers live on
a model hub this project does not reach. The units here are the family's markers (each
one unit, as a special token is) and single characters for the rest: finer than any real
tokenizer's pieces, so every split a real stream could make is among the ones tried, and
``special`` splits at the markers. The synthetic ``char:<seed>`` strategies split the
markers too. statecache streams several tokens in one delta (speculative decoding), so
every multi-unit strategy counts.
"""

from __future__ import annotations

import argparse
import collections
import functools
import re
import sys
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from canitoolcall.adapters.base import Adapter, ReplayInput, Support, ToolSpec
from canitoolcall.adapters.worker import replay
from canitoolcall.chunking import DEFAULT_STRATEGIES, ChunkStrategy
from canitoolcall.fixtures import Family, Fixture, load_fixtures
from canitoolcall.results import CaseResult, ParsedToolCall, ParseResult, Status
from canitoolcall.runner import evaluate, family_for

from proxy.api.render import ChatTemplate
from proxy.api.reply import StreamParser, starts_in_reasoning
from proxy.api.syntax.calls import Syntax
from proxy.api.syntax.probe import BY_NAME

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = ROOT / "vendor" / "templates" / "llama.cpp"
STRATEGIES: tuple[ChunkStrategy, ...] = (
    *DEFAULT_STRATEGIES, ChunkStrategy("char", 0), ChunkStrategy("char", 1),
    ChunkStrategy("char", 2))

# fixture model (a prefix of its repo id) -> the vendored template of its family, or a
# syntax by name where none is vendored
MODELS: tuple[tuple[str, str], ...] = (
    ("Qwen/Qwen3-Coder", "Qwen3-Coder.jinja"),
    ("Qwen/Qwen3.", "Qwen3.5-4B.jinja"),
    ("Qwen/Qwen3-", "Qwen-Qwen3-0.6B.jinja"),
    ("openai/gpt-oss", "openai-gpt-oss-120b.jinja"),
    ("deepseek-ai/DeepSeek-V3-", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"),
    ("deepseek-ai/DeepSeek-V3.1", "deepseek-ai-DeepSeek-V3.1.jinja"),
    ("deepseek-ai/DeepSeek-V3.2", "deepseek-ai-DeepSeek-V3.2.jinja"),
    ("deepseek-ai/DeepSeek-V4-Flash", "deepseek-ai-DeepSeek-V4-Flash-0731.jinja"),
    ("deepseek-ai/DeepSeek-V4", "deepseek-ai-DeepSeek-V4.jinja"),
    ("moonshotai/Kimi-K2.6", "Kimi-K2-Thinking.jinja"),
    ("moonshotai/Kimi-K2", "Kimi-K2-Instruct.jinja"),
    ("moonshotai/Kimi-K3", "Kimi-K3.jinja"),
    ("zai-org/GLM-4.5", "GLM-4.6.jinja"),
    ("zai-org/GLM", "GLM-4.7-Flash.jinja"),
    ("meta-llama/Llama-3", "meta-llama-Llama-3.3-70B-Instruct.jinja"),
    ("meta-llama/Llama-4", "pythonic"),
    ("mistralai/Mistral-7B", "mistralai-Mistral-Nemo-Instruct-2407.jinja"),
    ("mistralai/Devstral", "unsloth-mistral-Devstral-Small-2507.jinja"),
    ("mistralai/Ministral", "mistralai-Ministral-3-14B-Reasoning-2512.jinja"),
    ("mistralai/", "Mistral-Small-3.2-24B-Instruct-2506.jinja"),
    ("google/gemma-4", "google-gemma-4-31B-it.jinja"),
)


@functools.cache
def syntax_of(source: str) -> Syntax:
    """The syntax a vendored template is probed to write, or a syntax named."""
    if not source.endswith(".jinja"):
        return BY_NAME[source]
    text = (TEMPLATES / source).read_text(encoding="utf-8")
    return ChatTemplate(text, bos_token="<s>", eos_token="</s>", origin=source).syntax


def source_of(model: str) -> str | None:
    return next((src for prefix, src in MODELS if model.startswith(prefix)), None)


class StatecacheAdapter(Adapter):
    """canitoolcall's engine contract, over statecache's parsers (in this process)."""

    name = "statecache"
    pinned_version = "0.1.0"
    supports_text_deltas = True
    tokens_per_step = "many"

    def __init__(self) -> None:
        self._units: dict[str, list[str]] = {}
        self._family: Family | None = None

    def version(self) -> str:
        return self.pinned_version

    def supports(self, family: str, model: str) -> Support:
        src = source_of(model)
        if src is None:
            return Support(False, f"no template or syntax for {model}")
        if syntax_of(src).name == "none":
            return Support(False, f"{src} renders no tool calls we read")
        return Support(True)

    def parser_config(self, raw: ReplayInput) -> dict[str, Any]:
        src = source_of(raw.model)
        return {"source": src, "syntax": syntax_of(src).name if src else None,
                "starts_in_reasoning": self._in_reasoning(raw)}

    def _in_reasoning(self, raw: ReplayInput) -> bool:
        src = source_of(raw.model)
        assert src is not None
        return starts_in_reasoning(raw.generation_prompt or "", syntax_of(src))

    def _markers(self, raw: ReplayInput) -> list[str]:
        src = source_of(raw.model)
        assert src is not None
        syntax = syntax_of(src)
        marks = [*(self._family.markers if self._family else ()),
                 *(t for b in syntax.blocks for t in (b.open, b.close or "")),
                 *(t for pair in syntax.reasoning for t in pair), *syntax.drop]
        return sorted({m for m in marks if len(m) > 1}, key=len, reverse=True)

    def units(self, raw: ReplayInput) -> list[int]:
        """Indexes of the reply's units: markers whole, one character otherwise."""
        marks = self._markers(raw)
        pattern = re.compile("|".join(map(re.escape, marks)) + "|." if marks else ".", re.S)
        pieces = pattern.findall(raw.text)
        self._units[raw.fixture_id] = pieces
        return list(range(len(pieces)))

    def special_token_ids(self, raw: ReplayInput) -> Collection[int] | None:
        pieces = self._units[raw.fixture_id]
        return {i for i, p in enumerate(pieces) if len(p) > 1}

    def _run(self, raw: ReplayInput, deltas: Sequence[str], tools: Sequence[ToolSpec]
             ) -> ParseResult:
        src = source_of(raw.model)
        assert src is not None
        counter = iter(range(1_000_000))
        p = StreamParser(syntax_of(src), starts_in_reasoning=self._in_reasoning(raw),
                         tools=list(tools), make_id=lambda: f"call_{next(counter)}")
        reasoning, content, calls = "", "", []
        for d in [*deltas, None]:
            out = p.feed(d) if d is not None else p.finish(cut=raw.truncated)
            reasoning += out.reasoning
            content += out.content
            calls += [ParsedToolCall(c.name, c.arguments) for c in out.tool_calls]
        return ParseResult(content=content or None, reasoning_content=reasoning or None,
                           tool_calls=tuple(calls))

    def parse(self, raw: ReplayInput, tools: Sequence[ToolSpec]) -> ParseResult:
        return self._run(raw, [raw.text], tools)

    def parse_stream(self, raw: ReplayInput, chunks: Sequence[Sequence[int]],
                     tools: Sequence[ToolSpec]) -> ParseResult:
        pieces = self._units[raw.fixture_id]
        return self._run(raw, ["".join(pieces[i] for i in group) for group in chunks], tools)

    def parse_stream_text(self, raw: ReplayInput, deltas: Sequence[str],
                          tools: Sequence[ToolSpec]) -> ParseResult:
        return self._run(raw, list(deltas), tools)

    def replay(self, fixture: Fixture, family: Family | None) -> CaseResult:
        self._family = family
        reply = replay(self, fixture, family, STRATEGIES)
        return evaluate(fixture, family, reply, "failures")


def run(families: Sequence[str] = ()) -> list[CaseResult]:
    adapter = StatecacheAdapter()
    cache: dict[Path, Family | None] = {}
    fixtures = load_fixtures(None, families=list(families) or None)
    return [adapter.replay(f, family_for(f, cache)) for f in fixtures]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", action="append", default=[])
    ap.add_argument("--show-failures", action="store_true")
    args = ap.parse_args(argv)
    cases = run(args.family)
    by_family: dict[str, collections.Counter[str]] = collections.defaultdict(
        collections.Counter)
    for c in cases:
        by_family[c.family][c.status.value] += 1
        if args.show_failures and c.status in (Status.FAIL, Status.ERROR, Status.UNSUPPORTED):
            bad = [f"{r.check}[{r.strategy}]: {r.detail}" for r in c.checks
                   if r.status in (Status.FAIL, Status.ERROR)][:3]
            print(f"{c.status.value:11s} {c.fixture_id}: {c.reason or ''} {bad}")
    total: collections.Counter[str] = collections.Counter()
    for fam in sorted(by_family):
        total.update(by_family[fam])
        print(f"{fam:14s} " + "  ".join(f"{k}={v}" for k, v in sorted(by_family[fam].items())))
    print(f"{'total':14s} " + "  ".join(f"{k}={v}" for k, v in sorted(total.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
