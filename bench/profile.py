"""What a full benchmark run is made of (``Profile``: models, systems, sizes, the
sub-benchmarks' arguments) and what it gathers (``Results``), for bench.run and the
report it writes (bench.report)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness import Record
from bench.servers import ModelSpec


@dataclass(slots=True, frozen=True)
class Part:
    model: ModelSpec
    scale: float


@dataclass(slots=True, frozen=True)
class Profile:
    name: str
    parts: tuple[Part, ...]
    systems: tuple[str, ...]
    turns: int
    repeats: int  # of the base session (each with its repeat and edit requests)
    cold_repeats: int  # the same for the peers that re-prefill most of every turn
    variants: tuple[str, ...]  # besides base: strip, concurrent
    reply_tokens: int
    n_ctx: int
    micro_model: Path
    micro_args: tuple[str, ...]
    # batched steps and subagents (bench.batching, bench.subagents): model and arguments
    load_model: Path = Path()
    batching_args: tuple[str, ...] = ()
    subagent_args: tuple[str, ...] = ()
    remote_args: tuple[str, ...] = ()  # bench.remote (the shared tier), on load_model
    speculative_args: tuple[str, ...] = ()  # bench.speculative (its own models)
    pages_args: tuple[tuple[str, ...], ...] = ()  # bench.pages, one process per model
    replay_args: tuple[str, ...] = ()  # bench.replay (the agents' own requests)


@dataclass(slots=True)
class Results:
    records: list[Record] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    micro: dict[str, Any] | None = None
    batching: dict[str, Any] | None = None
    subagents: dict[str, Any] | None = None
    remote: dict[str, Any] | None = None  # bench.remote
    speculative: dict[str, Any] | None = None  # bench.speculative
    pages: list[dict[str, Any]] = field(default_factory=list)  # bench.pages
    replay: dict[str, Any] | None = None  # bench.replay
    llama_server: str = ""
