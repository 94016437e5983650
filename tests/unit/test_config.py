from __future__ import annotations

from pathlib import Path

import pytest

from statecache.config import ConfigError, load_config
from statecache.sizes import format_size, parse_duration, parse_size

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MiB", 512 << 20),
        ("8GiB", 8 << 30),
        ("1.5GB", 1_500_000_000),
        ("100", 100),
        ("4 KiB", 4096),
        (1234, 1234),
        ("2k", 2048),
    ],
)
def test_parse_size(text: object, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "8 parsecs", "-1GiB", [1], True, -5, "1.2.3MB"])
def test_parse_size_rejects(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_size(bad)


def test_format_and_duration() -> None:
    assert format_size(512) == "512 B" and format_size(3 << 30) == "3.0 GiB"
    assert parse_duration("2h") == 7200 and parse_duration("90") == 90
    with pytest.raises(ValueError):
        parse_duration("soon")


@pytest.mark.parametrize("name", ["default", "mac-metal", "hybrid-agent"])
def test_example_configs_load(name: str) -> None:
    cfg = load_config(REPO / "configs" / f"{name}.toml")
    assert cfg.cache.page_size >= 1 and cfg.server.lanes >= 1
    if name == "hybrid-agent":
        assert cfg.model.path == "models/hybrid-tiny.gguf" and cfg.server.lanes == 3


def test_default_config_file_is_the_defaults() -> None:
    # configs/default.toml says "these are the defaults": every key it sets must be
    # the value the code uses without it
    assert load_config(REPO / "configs" / "default.toml") == load_config(None)


def test_precedence_defaults_file_overrides(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text(
        '[server]\nport = 9000\nlanes = 4\n[cache]\nram_budget = "512MiB"\ndisk_path = "~/ck"\n'
    )
    cfg = load_config(f, {"server.port": 9100})
    assert (cfg.server.port, cfg.server.lanes, cfg.server.host) == (9100, 4, "127.0.0.1")
    assert cfg.cache.ram_budget == 512 << 20
    assert cfg.cache.disk_path == str(Path.home() / "ck")
    assert load_config(None).cache.ram_budget == 2 << 30


def write(tmp_path: Path, text: str) -> Path:
    f = tmp_path / "c.toml"
    f.write_text(text)
    return f


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[cache]\nram_budgte = 1\n", "valid keys: enabled, page_size, ram_budget"),
        ("[cashe]\nx = 1\n", "valid sections: model, server, cache, engine, log"),
        ("[cache]\nram_budget = [1]\n", 'cache.ram_budget: expected a size like "8GiB", got [1]'),
        ('[server]\nport = "80"\n', "server.port: expected int, got '80'"),
        ("[server]\nlanes = 0\n", "server.lanes: must be >= 1"),
        ("[server]\nport = 70000\n", "server.port: must be in 0..65535"),
        ("[cache]\npage_size = 0\n", "cache.page_size"),
        ("[cache]\nenabled = 1\n", "cache.enabled: expected bool"),
        ('[log]\nlevel = "loud"\n', "log.level"),
        ("[server\n", "not valid TOML"),
    ],
)
def test_config_errors_name_the_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    assert message in str(e.value)


def test_override_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="server.prot"):
        load_config(None, {"server.prot": 1})
    with pytest.raises(ConfigError, match="expected section.key"):
        load_config(None, {"port": 1})
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[speculative]\nsource = "eagle"\n', "speculative.source"),
        ('[speculative]\nsource = "draft"\n', "model.draft_path"),
        ("[speculative]\nlookup_min = 5\nlookup_max = 3\n", "lookup_min"),
        ("[speculative]\ndraft_max = 0\n", "speculative.draft_max"),
        ("[speculative]\ndraft_min_p = 1.5\n", "speculative.draft_min_p"),
    ],
)
def test_speculative_mistakes_are_named(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, text))


def test_speculative_defaults_and_agent_config() -> None:
    assert load_config(None).speculative.source == "auto"  # on by default (issue 30)
    assert load_config(REPO / "configs" / "default.toml").speculative.source == "auto"
    assert load_config(REPO / "configs" / "hybrid-agent.toml").speculative.source == "lookup"


def test_a_retired_key_is_ignored_with_a_warning(tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    p = tmp_path / "c.toml"
    p.write_text("[engine]\nhandoff_wait_ms = 20.0\nidle_save_s = 3.0\n")
    with caplog.at_level("WARNING", logger="statecache"):
        cfg = load_config(p)
    assert cfg.engine.idle_save_s == 3.0  # the rest of the table still applies
    assert "engine.handoff_wait_ms is ignored" in caplog.text
    p.write_text("[engine]\nhandoff_wait_msx = 20.0\n")
    with pytest.raises(ConfigError, match="unknown key engine.handoff_wait_msx"):
        load_config(p)


def test_exact_mode_needs_whole_ubatches_a_step() -> None:
    # a grid step is one ubatch (docs/exact.md): smaller prefill steps could never take one
    assert load_config(None, {"cache.exact": True}).cache.exact
    with pytest.raises(ConfigError, match="cache.exact needs prefill steps"):
        load_config(None, {"cache.exact": True, "engine.prefill_chunk": 256})
    with pytest.raises(ConfigError, match="cache.exact needs prefill steps"):
        load_config(None, {"cache.exact": True, "engine.step_tokens": 128})
    load_config(None, {"cache.exact": True, "engine.step_tokens": 1024, "model.n_ubatch": 512})


def test_a_window_sized_swa_cache_is_the_default_but_not_in_exact_mode(tmp_path: Path) -> None:
    assert not load_config(None).model.swa_full  # a window, as llama-server keeps
    assert load_config(write(tmp_path, "[model]\nswa_full = true\n")).model.swa_full
    # exact mode keeps every SWA cell unless told otherwise, and refuses a window
    assert load_config(None, {"cache.exact": True}).model.swa_full
    assert load_config(write(tmp_path, "[cache]\nexact = true\n")).model.swa_full
    with pytest.raises(ConfigError, match="cache.exact needs model.swa_full = true"):
        load_config(write(tmp_path, "[model]\nswa_full = false\n[cache]\nexact = true\n"))
