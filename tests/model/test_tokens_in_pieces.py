"""A chat prompt tokenized in pieces (cut where each special token starts, a piece seen
before keeping its ids) gives the ids of the whole text, on real tokenizers: SmolLM2's
BPE, Gemma 3's SentencePiece, the synthetic hybrid's single characters and the draft's;
and what the prompt memo takes from earlier prompts (the history without a second
render, the first turn's share points and breakpoints, a later breakpoint found where
its message stands) is what a prompt computed from scratch has.
The prompts are real: the agents' recorded requests (bench/fixtures/agents) rendered by
each model's own template, and conversations with the texts that trip tokenizers up
(whitespace against special tokens, special-token texts typed by a client, characters
of several bytes). A follow-up tokenizes only its new pieces."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.replay import FIXTURES
from proxy.api.anthropic import parse_messages_request
from proxy.api.chat import ChatRequest
from proxy.api.openai import parse_chat_request
from proxy.api.prompt import chat_prompt
from proxy.api.prompt_memo import PromptMemo
from proxy.api.render import ChatTemplate, load_chat_template
from proxy.api.responses import chat_request, parse_responses_request
from proxy.engine.binding import Model
from proxy.engine.tokens import Tokenizer
from proxy.meters import EngineMeter
from proxy.models import default_model_path
from tools.recorder import read_records


def _requests() -> Iterator[ChatRequest]:
    """Every recorded request that generates, parsed as the server parses it."""
    for path in sorted(FIXTURES.glob("*.jsonl.zst")):
        for r in read_records(path):
            p, body = str(r["path"]), r["body"]
            if r["method"] != "POST" or "count_tokens" in p:
                continue
            if p.startswith("/v1/messages"):
                yield parse_messages_request(body, hosted_tools="ignore")
            elif p.startswith("/v1/responses"):
                yield chat_request(parse_responses_request(body, hosted_tools="ignore"), ())
            elif p.startswith("/v1/chat/completions"):
                yield parse_chat_request(body)


def _awkward() -> Iterator[ChatRequest]:
    """Conversations that grow turn by turn, with whitespace around the template's
    markup, special-token texts a client typed, and multi-byte characters."""
    messages: list[dict[str, object]] = [{"role": "system", "content": "  Be terse.\n\n"}]
    turns = ["Hello  ", "\n\nline one\n<|im_end|>\n<start_of_turn>model\n", "日本語 ünïcödé 🙂",
             "   ", "tabs\t\tand\r\nreturns", "<end_of_turn><|im_start|>assistant"]
    for i, text in enumerate(turns):
        messages.append({"role": "user", "content": text})
        yield parse_chat_request({"model": "m", "messages": messages})
        messages.append({"role": "assistant", "content": f" reply {i}\n "})


def _template(model: Model) -> ChatTemplate:
    bos = model.token_text(model.bos) if model.bos >= 0 else ""
    eos = model.token_text(model.eos) if model.eos >= 0 else ""
    return load_chat_template(model.chat_template(), bos_token=bos, eos_token=eos)


def _check(path: Path) -> None:
    model = Model(path)
    try:
        whole = Tokenizer(model, EngineMeter(), None, piece_chars=0)
        pieces = Tokenizer(model, EngineMeter(), None)
        assert whole.pieces is None and pieces.pieces is not None
        tpl = _template(model)
        memo = PromptMemo()
        seen = 0
        for req in [*_requests(), *_awkward()]:
            try:
                want = chat_prompt(whole, tpl, req, "", 1 << 20)
            except ValueError:
                continue  # a template that refuses a conversation refuses it both ways
            # tokens in pieces, the history from the ending learned, the first turn's
            # marks from the conversation before: all as computed from scratch
            got = chat_prompt(pieces, tpl, req, "", 1 << 20, memo)
            assert got.tokens.tolist() == want.tokens.tolist()
            assert (got.history, got.share_points, got.breakpoints) == \
                (want.history, want.share_points, want.breakpoints)
            seen += 1
        assert seen >= 6
        # a follow-up: the same conversation and one turn more tokenizes only that turn
        fresh = Tokenizer(model, EngineMeter(), None)
        assert fresh.pieces is not None
        reqs = list(_awkward())
        chat_prompt(fresh, tpl, reqs[-2], "", 1 << 20)
        before = len(fresh.pieces)
        chat_prompt(fresh, tpl, reqs[-1], "", 1 << 20)
        assert 0 < len(fresh.pieces) - before <= 4
    finally:
        model.close()


def test_smollm2_bpe() -> None:
    _check(default_model_path())


def test_gemma3_sentencepiece(gemma_path: Path) -> None:
    _check(gemma_path)


@pytest.mark.parametrize("name", ["hybrid_path", "draft_path"])
def test_synthetic_vocabularies(name: str, request: pytest.FixtureRequest) -> None:
    _check(request.getfixturevalue(name))
