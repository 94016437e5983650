"""Bounds on one request: JSON depth, the context from the byte length, config keys."""

from __future__ import annotations

import json
import re

import pytest

from proxy.api.fields import ApiError
from proxy.api.intake import MAX_DEPTH, check_depth, check_text, may_hold_surrogates
from proxy.api.prompt import _history_cut, check_fits, utf8_len
from proxy.engine.binding.vocab import alternation
from statecache.config import ConfigError, load_config


def _nested(depth: int) -> object:
    v: object = "x"
    for i in range(depth):
        v = [v] if i % 2 else {"k": v}
    return v


def test_depth_limit_is_exact_and_iterative() -> None:
    check_depth(_nested(MAX_DEPTH))
    with pytest.raises(ApiError, match="nests deeper"):
        check_depth(_nested(MAX_DEPTH + 1))
    with pytest.raises(ApiError):
        check_depth(_nested(50_000))  # far past the recursion limit: no RecursionError


@pytest.mark.parametrize(("raw", "where", "param"), [
    (rb'{"user": "\ud800"}', "'user' holds a lone UTF-16 surrogate (U+D800)", "user"),
    (rb'{"messages": [{"content": "a\uDC00b"}]}',
     "'messages[0].content' holds a lone UTF-16 surrogate (U+DC00)", "messages[0].content"),
    (rb'{"a": [1, ["\udbff\udbff"]]}', "'a[1][0]' holds", "a[1][0]"),
    (rb'{"metadata": {"ok": 1, "\uDe00": 2}}', "a key of 'metadata' holds", "metadata"),
    (rb'{"\udfff": 1}', "a top-level key holds", None),
    (rb'"\ud800"', "the body holds", None),
    (b'{"x": "\xed\xa0\x80"}', "'x' holds", "x"),  # a surrogate's bytes: not UTF-8
    ('{"x": "\ud800"}'.encode("utf-16", "surrogatepass"), "'x' holds", "x"),
])
def test_a_lone_surrogate_anywhere_is_refused(raw: bytes, where: str, param: str | None
                                              ) -> None:
    assert may_hold_surrogates(raw)
    with pytest.raises(ApiError) as e:
        check_text(json.loads(raw))
    assert str(e.value).startswith(where) and e.value.param == param
    assert "not a character" in str(e.value)


def test_pairs_and_escaped_backslashes_are_text() -> None:
    for raw in (rb'{"a": "\ud83d\ude00"}', rb'{"a": "\\ud800"}', '{"é": ["😀"]}'.encode()):
        check_text(json.loads(raw))


def test_only_bodies_that_may_hold_a_surrogate_are_searched() -> None:
    # plain text, other escapes, Hangul (U+D55C: UTF-8 lead byte 0xED, escape \ud55c)
    for raw in (b'{"a": "x\\n\\u00e9"}', '{"a": "\ud55c"}'.encode(), rb'{"a": "\ud55c"}'):
        assert not may_hold_surrogates(raw), raw
    assert may_hold_surrogates(rb'{"a": "\uD83D\uDE00"}')  # a pair: searched, and fine


def test_a_text_past_the_context_is_refused_from_its_length() -> None:
    # 16 bytes per token at most: 1,600 bytes are at least 100 tokens
    check_fits(1_600, 16, n_ctx=101, asked=None, param="messages")
    with pytest.raises(ApiError) as e:
        check_fits(1_616, 16, n_ctx=101, asked=None, param="messages")
    assert (e.value.param, e.value.code) == ("messages", "context_length_exceeded")
    check_fits(1_600, 16, n_ctx=110, asked=10, param="prompt")
    with pytest.raises(ApiError, match="max_tokens is 11"):
        check_fits(1_600, 16, n_ctx=110, asked=11, param="prompt")
    check_fits(10**9, None, n_ctx=10, asked=None, param="prompt")  # no bound known
    assert utf8_len("aé→😀") == 1 + 2 + 3 + 4


SPECIAL_RE = re.compile(alternation(["<|im_start|>", "<|im_end|>"]))


def test_history_cut_falls_where_a_special_token_starts() -> None:
    history = "<|im_start|>user\nhi<|im_end|>\n"
    # the generation prompt starts with a special token: cut at the history's end
    assert _history_cut(history + "<|im_start|>assistant\n", history, SPECIAL_RE) == len(history)
    # it starts with text: cut at the last special token before the history's end
    assert _history_cut(history + "Assistant:", history, SPECIAL_RE) == history.index("<|im_end|>")
    assert _history_cut("no markup at all!", "no markup", SPECIAL_RE) is None
    assert _history_cut("abc", "abd", SPECIAL_RE) is None


def test_server_keys_parse_and_check() -> None:
    cfg = load_config(None, {"server.max_body": "1MiB", "server.parse_concurrency": 3,
                             "server.api_keys": {"sk-a": "alice"}, "server.admin_key": "sk-x",
                             "server.admin": False})
    s = cfg.server
    assert (s.max_body, s.parse_concurrency, s.api_keys, s.admin_key, s.admin) == (
        1 << 20, 3, {"sk-a": "alice"}, "sk-x", False)
    assert "sk-a" not in repr(cfg) and "sk-x" not in repr(cfg)  # keys stay out of logs
    assert load_config(None).server.host == "127.0.0.1"
    bad_values: list[tuple[dict[str, object], str]] = [
        ({"server.api_keys": ["sk-a"]}, "server.api_keys"),
        ({"server.api_keys": {"sk-a": 1}}, "server.api_keys"),
        ({"server.parse_concurrency": 0}, "server.parse_concurrency"),
        ({"server.max_body": "12"}, "server.max_body")]
    for bad, msg in bad_values:
        with pytest.raises(ConfigError, match=msg):
            load_config(None, bad)
