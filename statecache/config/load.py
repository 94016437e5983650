"""Reading the configuration: one TOML file into the frozen dataclasses of sections.py;
defaults < file < overrides. Unknown sections and keys are refused with the list of
valid ones; each value is checked for its type and range, sizes parsed ("8GiB")."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from statecache.config.sections import (
    HOSTED_TOOLS,
    INNER_SYSTEM,
    LOG_LEVELS,
    SPECULATIVE_SOURCES,
    TOOL_FORMATS,
    CacheConfig,
    Config,
    ConfigError,
    EngineConfig,
    LogConfig,
    ModelConfig,
    RemoteConfig,
    SamplingConfig,
    ServerConfig,
    SpeculativeConfig,
    VolatileRule,
)
from statecache.sizes import parse_size

_NO_OVERRIDES: Mapping[str, object] = MappingProxyType({})

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
    if cfg.cache.exact and "swa_full" not in raw["model"]:
        # exact mode restarts from grid points only a full-size SWA cache reaches
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, swa_full=True))
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
    if cfg.cache.exact:
        step = cfg.engine.step_tokens or cfg.model.n_batch
        chunk = min(cfg.engine.prefill_chunk or step, step)
        if chunk < cfg.model.n_ubatch:  # a grid step is one whole ubatch (docs/exact.md)
            raise ConfigError(f"cache.exact needs prefill steps of model.n_ubatch "
                              f"({cfg.model.n_ubatch}) tokens; engine.step_tokens and "
                              f"engine.prefill_chunk give {chunk}")
    if cfg.cache.exact and not cfg.model.swa_full:
        # exact mode goes back to grid points a window-sized SWA cache cannot reach
        raise ConfigError("cache.exact needs model.swa_full = true: a window-sized SWA cache "
                          "cannot roll a lane back to the grid points exact mode restarts from")
    if cfg.speculative.source == "draft" and not cfg.model.draft_path:
        raise ConfigError('speculative.source = "draft" needs model.draft_path')
    for key, choices in (("server.inner_system", INNER_SYSTEM),
                         ("model.tool_format", TOOL_FORMATS),
                         ("server.hosted_tools", HOSTED_TOOLS)):
        if get_value(cfg, key) not in choices:
            raise ConfigError(f"{key}: expected one of {', '.join(choices)}, got "
                              f"{get_value(cfg, key)!r}")
    if cfg.log.level.lower() not in LOG_LEVELS:
        raise ConfigError(
            f"log.level: expected one of {', '.join(LOG_LEVELS)}, got {cfg.log.level!r}"
        )
