"""bench.speculative's sources: each one's [speculative] section is a config the server
loads, and ``fixedN`` turns the adaptive rule off."""

import pytest

from bench.speculative import source_config
from statecache.config import load_config


@pytest.mark.parametrize("source", ["off", "auto", "lookup"])
def test_a_named_source_is_the_speculative_source(tmp_path, source):
    path = tmp_path / "c.toml"
    path.write_text(source_config(source))
    cfg = load_config(path).speculative
    assert cfg.source == source and cfg.adaptive


def test_a_fixed_length_drafts_lookup_without_the_adaptive_rule(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(source_config("fixed3"))
    cfg = load_config(path).speculative
    assert (cfg.source, cfg.adaptive, cfg.lookup_draft_max) == ("lookup", False, 3)
