"""Configuration: one TOML file into frozen dataclasses; defaults < file < overrides."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from statecache.sizes import parse_size

_SIZE = {"size": True}
_NO_OVERRIDES: Mapping[str, object] = MappingProxyType({})
LOG_LEVELS = ("debug", "info", "warning", "error")
INNER_SYSTEM = ("auto", "fold", "keep")
HOSTED_TOOLS = ("ignore", "reject")
SPECULATIVE_SOURCES = ("off", "lookup", "draft", "auto")


class ConfigError(ValueError):
    """A configuration mistake; the message names the key."""


@dataclass(slots=True, frozen=True)
class ModelConfig:
    # a GGUF path or a model's name (proxy/models/names.py); empty: the bundled SmolLM2
    path: str = ""
    draft_path: str = ""
    n_ctx: int = 0  # tokens per lane; 0: chosen from the training context and kv_budget
    kv_budget: int = field(default=4 << 30, metadata=_SIZE)  # for n_ctx = 0: KV of all lanes
    n_batch: int = 512
    n_ubatch: int = 512
    n_gpu_layers: int = -1
    n_rs_seq: int = 0
    chat_template: str = ""  # a .jinja file overriding the GGUF's template
    threads: int = 0  # 0: auto


@dataclass(slots=True, frozen=True)
class VolatileRule:
    """A fragment of message text that changes per conversation (a session id, a date):
    replaced before rendering so prompts that differ only there share their prefix.
    One ``[[server.volatile]]`` table; off unless configured (the model reads the result)."""

    pattern: str  # a Python regular expression
    replace: str = ""  # re.sub's replacement (\\1 refers to a group)
    name: str = ""  # the rule's label in /metrics (default: its index)


@dataclass(slots=True, frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    lanes: int = 4  # one batch per step makes lanes cheap (docs/engine.md, "One batch per step")
    queue_size: int = 16
    request_timeout: float = 600.0
    max_tokens_default: int = 512
    max_body: int = field(default=8 << 20, metadata=_SIZE)  # larger request bodies get 413
    parse_concurrency: int = 2  # requests read, parsed and tokenized at the same time
    # A stream is written at most once per this long: tokens that come sooner go with
    # the next write (its first and last tokens go at once, and none waits through a
    # step that prefills or saves). 32: as often as Ink, the terminal UI that Claude Code
    # draws with, redraws. 0: every step's tokens at once. docs/engine.md, "Writes on a clock".
    stream_interval_ms: float = 32.0
    # API key -> tenant. Set: every request needs a known key, whose tenant it gets.
    api_keys: dict[str, str] = field(default_factory=dict, repr=False)
    admin_key: str = field(default="", repr=False)  # the admin routes need it once any key is set
    admin: bool = True  # false: no admin routes at all
    volatile: tuple[VolatileRule, ...] = ()  # [[server.volatile]]: rewrites of message text
    # A system or developer message after the first (docs/agents.md): "auto"
    # keeps it in place where the chat template renders it there, else folds it into the
    # conversation as marked user text; "fold": always; "keep": as sent (a template that
    # refuses it makes the request a 400)
    inner_system: str = "auto"
    # Tools that the API's own servers run (Responses' web_search, Anthropic's server
    # tools): "ignore" leaves them out of the prompt (a warning per type, a counter);
    # "reject" answers 400
    hosted_tools: str = "ignore"


@dataclass(slots=True, frozen=True)
class EngineConfig:
    """How the engine builds each step (one llama_decode for every lane)."""

    step_tokens: int = 0  # tokens per step, decode and prefill together; 0: model.n_batch
    prefill_chunk: int = 0  # most prompt tokens of one lane per step; 0: step_tokens
    # While streams decode, a long prompt prefills in bursts (proxy/engine/steps.py):
    # one step of at most this long, then the streams alone for as long as it took
    # (``decode_share`` of the time is theirs); 0: no limit.
    prefill_pause_ms: float = 400.0
    decode_share: float = 0.5
    min_prefill_chunk: int = 16  # the smallest burst, however slow a token is
    idle_save_s: float = 2.0  # an idle lane's state is saved FULL after this long; 0: never
    # One stream decoding with nothing else to do runs steps of its own, without
    # planning each one, for up to this long between the loop's checks; 0: every step
    # is planned
    lone_run_ms: float = 250.0
    # A persistent ggml threadpool for the context and its draft's (builds without
    # OpenMP): its workers poll this long between decodes (0-100, ggml's scale; 50 is
    # llama-server's) before they sleep; -1: none (llama.cpp then starts the threads of
    # every decode anew, which stalled the sub-millisecond decodes of tiny models)
    thread_poll: int = 50
    # Check the engine's invariants after every step (proxy/engine/checks.py): the tests
    # turn it on; it costs a pass over every lane's tokens a step
    sanity_checks: bool = False


@dataclass(slots=True, frozen=True)
class RemoteConfig:
    """``[cache.remote]``: the shared tier on Redis or Valkey (off while ``url`` is empty)."""

    # redis://, rediss://, valkey://, valkeys:// or unix:// (host, port, db, password)
    url: str = field(default="", repr=False)
    cluster: bool = False  # the URL names one node of a Redis/Valkey cluster
    prefix: str = "statecache"  # every key starts with "<prefix>:"
    ttl: float = 7 * 86400.0  # seconds an entry lives after it was written or last used; 0: forever
    chunk_size: int = field(default=4 << 20, metadata=_SIZE)  # bytes per stored value
    max_entry: int = field(default=4 << 30, metadata=_SIZE)  # larger states are not shared
    queue_bytes: int = field(default=1 << 30, metadata=_SIZE)  # writes waiting; oldest dropped
    timeout: float = 2.0  # seconds for one command (connect: a tenth, at least 0.1)
    retry_s: float = 5.0  # after a failure, the store is tried again this much later
    # The key that signs shared entries; every proxy sharing the store needs a copy.
    # Empty: cache.secret_path (the disk tier's key).
    secret_path: str = ""


@dataclass(slots=True, frozen=True)
class CacheConfig:
    enabled: bool = True
    page_size: int = 32
    ram_budget: int = field(default=2 << 30, metadata=_SIZE)
    disk_path: str = "~/.cache/statecache/checkpoints"
    disk_budget: int = field(default=16 << 30, metadata=_SIZE)
    # checkpoints the disk tier holds at most, whatever their bytes: each keeps a head in
    # memory (about 3 KiB with its page keys and trie nodes), and KV pages make a
    # checkpoint small on disk, so the byte budget alone would let the index grow for long
    disk_max_checkpoints: int = 20000
    disk_enabled: bool = True
    # The key authenticating disk checkpoints: 32 random bytes, 0600, made on first use;
    # kept outside disk_path, since whoever can write it can forge checkpoints.
    secret_path: str = "~/.local/state/statecache/secret.key"
    periodic_pages: int = 64
    # FULL checkpoints at most per prompt where its first turn's messages and parts start,
    # for new conversations that share instructions, tools and environment (largest gaps
    # first); 0: none
    share_points: int = 4
    # on a hybrid, the first turn's end and its share points at most this many tokens
    # past the end of a prefill step move down to it, where they cut no step short (the
    # reuse a new conversation gives up there: python -m bench.share_grid); 0: none
    share_grid_tokens: int = 0
    splice_generated: bool = False
    tenant: str = ""
    # zstd level for what goes to disk and to the shared tier (statecache/codec.py: a
    # piece is kept compressed only where that saves a quarter of it); 0: none
    compress_level: int = 1
    remote: RemoteConfig = field(default_factory=RemoteConfig)  # [cache.remote]


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    """Speculative decoding (proxy/engine/drafting.py): drafts verified in the step."""

    # "off"; "lookup": prompt lookup (n-grams of the prompt and reply, no model);
    # "draft": the draft model at model.draft_path; "auto": the draft model if
    # model.draft_path is set, else prompt lookup
    source: str = "auto"
    # tokens drafted per lane and step; 3 from `python -m bench.speculative --rollback-check
    # --pair bench [--draft-max 4]`: 33.6 tokens/s against 22.2 undrafted, 31.0 with 4
    draft_max: int = 3
    draft_min_p: float = 0.5  # a draft model stops where its likeliest token is less likely
    lookup_max: int = 4  # longest n-gram prompt lookup matches
    lookup_min: int = 2  # shortest
    # most tokens prompt lookup drafts a step (draft_max where a hybrid rolls back by
    # n_rs_seq snapshots); the engine drafts fewer where fewer pay (bench.speculative)
    lookup_draft_max: int = 8
    # true: each lane drafts only while drafting pays there (proxy/engine/speculation.py);
    # false: every lane drafts what its source proposes at every step
    adaptive: bool = True
    # replies remembered for prompt lookup (proxy/engine/drafting.py History): this many
    # recent conversations (tenant and session), their last history_tokens tokens each
    history_sessions: int = 64
    history_tokens: int = 16384
    catch_up: int = 256  # most tokens a step a draft model decodes to follow its target lane
    # how a hybrid target that has n_rs_seq snapshots drops rejected drafts: "snapshots"
    # (n_rs_seq = draft_max + 1: every decode keeps per-token states), "staged" (a partial
    # save before each verification, restored on a rejection); "auto": staged (snapshots
    # make every decode dearer, drafted or not: bench.speculative's rollback table)
    rollback: str = "auto"


@dataclass(slots=True, frozen=True)
class SamplingConfig:
    """Sampling defaults; a GGUF's ``general.sampling.*`` values override them (unless
    ``model_defaults`` is false), and a request's own fields override both."""

    temperature: float = 0.8  # 0: greedy
    top_k: int = 40  # 0: off
    top_p: float = 0.95  # 1: off
    min_p: float = 0.05  # 0: off
    typical_p: float = 1.0  # 1: off
    repeat_penalty: float = 1.0  # 1: off
    repeat_last_n: int = 64  # tokens the penalties look back over; -1: the whole context
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    dry_multiplier: float = 0.0  # 0: DRY off
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    xtc_probability: float = 0.0  # 0: XTC off
    xtc_threshold: float = 0.1
    model_defaults: bool = True  # apply the GGUF's general.sampling.* values


@dataclass(slots=True, frozen=True)
class LogConfig:
    level: str = "info"
    llama_verbose: bool = False


@dataclass(slots=True, frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    log: LogConfig = field(default_factory=LogConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)


_SECTIONS: dict[str, type[Any]] = {
    "model": ModelConfig,
    "server": ServerConfig,
    "cache": CacheConfig,
    "engine": EngineConfig,
    "log": LogConfig,
    "sampling": SamplingConfig,
    "speculative": SpeculativeConfig,
}
# (key, lowest, highest) checked after conversion
_RANGES: tuple[tuple[str, float, float | None], ...] = (
    ("model.n_ctx", 0, None),
    ("cache.disk_max_checkpoints", 1, None),
    ("model.kv_budget", 1 << 20, None),
    ("engine.step_tokens", 0, None),
    ("engine.prefill_chunk", 0, None),
    ("engine.prefill_pause_ms", 0, None),
    ("engine.decode_share", 0.05, 0.95),
    ("engine.min_prefill_chunk", 1, None),
    ("engine.idle_save_s", 0, None),
    ("engine.lone_run_ms", 0, 60000),
    ("engine.thread_poll", -1, 100),
    ("model.n_batch", 1, None),
    ("model.n_ubatch", 1, None),
    ("model.n_gpu_layers", -1, None),
    ("model.n_rs_seq", 0, None),
    ("model.threads", 0, None),
    ("speculative.draft_max", 1, 32),
    ("speculative.draft_min_p", 0, 1),
    ("cache.compress_level", 0, 22),
    ("speculative.lookup_max", 1, 64),
    ("speculative.lookup_min", 1, 64),
    ("speculative.lookup_draft_max", 1, 64),
    ("speculative.history_sessions", 0, 4096),
    ("speculative.history_tokens", 0, 1 << 20),
    ("speculative.catch_up", 1, None),
    ("server.port", 0, 65535),
    ("server.lanes", 1, None),
    ("server.queue_size", 0, None),
    ("server.request_timeout", 0.001, None),
    ("server.max_tokens_default", 1, None),
    ("server.max_body", 1024, None),
    ("server.parse_concurrency", 1, None),
    ("server.stream_interval_ms", 0, 1000),
    ("cache.page_size", 1, None),
    ("cache.periodic_pages", 0, None),
    ("cache.share_points", 0, 64),
    ("cache.share_grid_tokens", 0, None),
    ("sampling.temperature", 0, None),
    ("sampling.top_k", 0, None),
    ("sampling.top_p", 0, 1),
    ("sampling.min_p", 0, 1),
    ("sampling.typical_p", 0, 1),
    ("sampling.repeat_penalty", 0, None),
    ("sampling.repeat_last_n", -1, None),
    ("sampling.presence_penalty", -2, 2),
    ("sampling.frequency_penalty", -2, 2),
    ("sampling.dry_multiplier", 0, None),
    ("sampling.dry_base", 1, None),
    ("sampling.dry_allowed_length", 0, None),
    ("sampling.dry_penalty_last_n", -1, None),
    ("sampling.xtc_probability", 0, 1),
    ("sampling.xtc_threshold", 0, 1),
)
_PATHS = (
    "model.path",
    "model.draft_path",
    "model.chat_template",
    "cache.disk_path",
    "cache.secret_path",
)


def _convert(key: str, f: dataclasses.Field[Any], value: object) -> object:
    if f.metadata.get("size"):
        try:
            return parse_size(value)
        except ValueError:
            raise ConfigError(f'{key}: expected a size like "8GiB", got {value!r}') from None
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    if kind == "tuple[VolatileRule, ...]":
        return _volatile_rules(key, value)
    if kind == "RemoteConfig":
        return _remote(key, value)
    if kind == "dict[str, str]":
        if not isinstance(value, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise ConfigError(f"{key}: expected a table of strings, got {value!r}")
        return dict(value)
    ok = {
        "str": isinstance(value, str),
        "bool": isinstance(value, bool),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, int | float) and not isinstance(value, bool),
    }[kind]
    if not ok:
        raise ConfigError(f"{key}: expected {kind}, got {value!r}")
    return float(value) if kind == "float" else value  # type: ignore[arg-type]


def _volatile_rule(key: str, value: object) -> VolatileRule:
    """One ``[[server.volatile]]`` table, its pattern compiled now so a bad one stops the load."""
    valid = [f.name for f in dataclasses.fields(VolatileRule)]
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key}: expected a table with {', '.join(valid)}, got {value!r}")
    for k, v in value.items():
        if k not in valid:
            raise ConfigError(f"{key}: unknown key {k!r}; valid keys: {', '.join(valid)}")
        if not isinstance(v, str):
            raise ConfigError(f"{key}.{k}: expected str, got {v!r}")
    if "pattern" not in value:
        raise ConfigError(f"{key}: a rule needs a pattern")
    rule = VolatileRule(**value)
    try:
        rx = re.compile(rule.pattern)
        rx.sub(rule.replace, "")  # compiles the replacement too: a missing group fails here
    except (re.error, IndexError) as e:
        raise ConfigError(f"{key} ({rule.pattern!r}): {e}") from None
    if rx.search("") is not None:
        raise ConfigError(f"{key} ({rule.pattern!r}): the pattern matches the empty text, "
                          "so it would rewrite every message everywhere")
    return rule


_REMOTE_RANGES = (("ttl", 0.0), ("chunk_size", 4096), ("max_entry", 1), ("queue_bytes", 0),
                  ("timeout", 0.01), ("retry_s", 0.0))
_REMOTE_SCHEMES = ("redis://", "rediss://", "valkey://", "valkeys://", "unix://")


def _remote(key: str, value: object) -> RemoteConfig:
    """The ``[cache.remote]`` table: keys checked like a section's, paths expanded."""
    if isinstance(value, RemoteConfig):
        return value
    valid = [f.name for f in dataclasses.fields(RemoteConfig)]
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key}: expected a table ([{key}]), got {value!r}")
    values: dict[str, object] = {}
    for f in dataclasses.fields(RemoteConfig):
        if f.name in value:
            values[f.name] = _convert(f"{key}.{f.name}", f, value[f.name])
    for k in value:
        if k not in valid:
            raise ConfigError(f"unknown key {key}.{k}; valid keys: {', '.join(valid)}")
    rc = RemoteConfig(**values)  # type: ignore[arg-type]
    for name, lo in _REMOTE_RANGES:
        if getattr(rc, name) < lo:
            raise ConfigError(f"{key}.{name}: must be >= {lo}, got {getattr(rc, name)}")
    if rc.url and not rc.url.startswith(_REMOTE_SCHEMES):
        raise ConfigError(f"{key}.url: expected one of {', '.join(_REMOTE_SCHEMES)}, got "
                          f"{rc.url.split('@')[-1]!r}")
    if rc.secret_path:
        rc = dataclasses.replace(rc, secret_path=str(Path(rc.secret_path).expanduser()))
    return rc


def _volatile_rules(key: str, value: object) -> tuple[VolatileRule, ...]:
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{key}: expected an array of tables ([[{key}]]), got {value!r}")
    rules = tuple(_volatile_rule(f"{key}[{i}]", v) for i, v in enumerate(value))
    names = [r.name for r in rules if r.name]
    if len(set(names)) != len(names):
        raise ConfigError(f"{key}: rule names must differ, got {names}")
    return rules


# Keys that older versions took and this one ignores, with why: a config that still
# sets one starts, with a warning, instead of failing on an unknown key.
_RETIRED = MappingProxyType({
    "engine.handoff_wait_ms": "the engine no longer waits for the event loop after a step "
                              "(it measured no gain)",
})


def _merge(raw: dict[str, dict[str, object]], data: Mapping[str, object], source: str) -> None:
    for section, table in data.items():
        if section not in _SECTIONS:
            raise ConfigError(
                f"{source}: unknown section [{section}]; valid sections: {', '.join(_SECTIONS)}"
            )
        if not isinstance(table, Mapping):
            raise ConfigError(f"{source}: [{section}] must be a table, got {table!r}")
        valid = [f.name for f in dataclasses.fields(_SECTIONS[section])]
        for key, value in table.items():
            if f"{section}.{key}" in _RETIRED:
                logging.getLogger("statecache").warning(
                    "%s: %s.%s is ignored: %s", source, section, key,
                    _RETIRED[f"{section}.{key}"])
                continue
            if key not in valid:
                raise ConfigError(
                    f"{source}: unknown key {section}.{key}; valid keys: {', '.join(valid)}"
                )
            old = raw[section].get(key)
            if isinstance(old, Mapping) and isinstance(value, Mapping):  # nested: key by key
                value = {**old, **value}
            raw[section][key] = value


def _split_overrides(overrides: Mapping[str, object]) -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    for dotted, value in overrides.items():
        section, sep, key = dotted.partition(".")
        if not sep or not key:
            raise ConfigError(f"override {dotted!r}: expected section.key")
        head, dot, tail = key.partition(".")
        if dot:  # cache.remote.url: a key of a nested table
            table = out.setdefault(section, {}).setdefault(head, {})
            if not isinstance(table, dict):
                raise ConfigError(f"override {dotted!r}: {section}.{head} is not a table")
            table[tail] = value
        else:
            out.setdefault(section, {})[key] = value
    return out


def load_config(
    path: str | Path | None = None, overrides: Mapping[str, object] = _NO_OVERRIDES
) -> Config:
    """Defaults < the TOML file at ``path`` < ``overrides`` ({"server.port": 9000})."""
    raw: dict[str, dict[str, object]] = {name: {} for name in _SECTIONS}
    if path is not None:
        p = Path(path).expanduser()
        try:
            with p.open("rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {p}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: not valid TOML: {e}") from None
        _merge(raw, data, str(p))
    _merge(raw, _split_overrides(overrides), "overrides")
    sections: dict[str, Any] = {}
    for name, cls in _SECTIONS.items():
        values: dict[str, object] = {}
        for f in dataclasses.fields(cls):
            key = f"{name}.{f.name}"
            if f.name in raw[name]:
                values[f.name] = _convert(key, f, raw[name][f.name])
            if key in _PATHS:
                v = values.get(f.name, f.default)
                if isinstance(v, str) and v:
                    # model.path may be a model's name (qwen3.5:27b, org/repo): kept as typed
                    values[f.name] = os.path.expanduser(v) if key == "model.path" else \
                        str(Path(v).expanduser())
        sections[name] = cls(**values)
    cfg = Config(**sections)
    _validate(cfg)
    return cfg


def get_value(cfg: Config, key: str) -> object:
    section, _, name = key.partition(".")
    return getattr(getattr(cfg, section), name)


def _validate(cfg: Config) -> None:
    for key, lo, hi in _RANGES:
        v = get_value(cfg, key)
        assert isinstance(v, int | float)
        if v < lo or (hi is not None and v > hi):
            span = f">= {lo}" if hi is None else f"in {lo}..{hi}"
            raise ConfigError(f"{key}: must be {span}, got {v}")
    if cfg.speculative.source not in SPECULATIVE_SOURCES:
        raise ConfigError(f"speculative.source: expected one of "
                          f"{', '.join(SPECULATIVE_SOURCES)}, got {cfg.speculative.source!r}")
    if cfg.speculative.rollback not in ("auto", "snapshots", "staged"):
        raise ConfigError(f"speculative.rollback: expected auto, snapshots or staged, got "
                          f"{cfg.speculative.rollback!r}")
    if cfg.speculative.lookup_min > cfg.speculative.lookup_max:
        raise ConfigError("speculative.lookup_min must be at most speculative.lookup_max")
    if cfg.speculative.source == "draft" and not cfg.model.draft_path:
        raise ConfigError('speculative.source = "draft" needs model.draft_path')
    for key, choices in (("server.inner_system", INNER_SYSTEM),
                         ("server.hosted_tools", HOSTED_TOOLS)):
        if get_value(cfg, key) not in choices:
            raise ConfigError(f"{key}: expected one of {', '.join(choices)}, got "
                              f"{get_value(cfg, key)!r}")
    if cfg.log.level.lower() not in LOG_LEVELS:
        raise ConfigError(
            f"log.level: expected one of {', '.join(LOG_LEVELS)}, got {cfg.log.level!r}"
        )
