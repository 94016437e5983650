"""A character the vocabulary cannot encode is a 400 naming it, never a dead process.

llama.cpp's SentencePiece tokenizer throws ``std::out_of_range`` through ctypes for a
character that is neither in the vocabulary nor covered by byte tokens, which aborts
the whole server. The model here is the synthetic draft model with the byte-fallback
tokens, the tab and the arrow renamed away (same ids, so the same weights).
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import gguf
import openai
import pytest
from gguf import TokenType

from tests.http.conftest import serve
from tools import synth_gguf as synth

pytestmark = pytest.mark.http

MISSING = ("\t", "→")


def write_model_without_byte_fallback(path: Path) -> Path:
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("nobytes-tiny")
    tensors = synth.build_llama(w, "nobytes")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    tokens, types = list(synth.VOCAB.tokens), list(synth.VOCAB.types)
    for i, (text, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind == TokenType.BYTE or text in MISSING:
            tokens[i], types[i] = f"[unused {i}]", int(TokenType.UNUSED)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(synth.VOCAB.scores)
    w.add_token_types(types)
    w.add_bos_token_id(synth.SPECIAL_IDS["<|endoftext|>"])
    w.add_eos_token_id(synth.SPECIAL_IDS["<|im_end|>"])
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    w.add_chat_template(synth.chat_template())
    tensors.write(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def nobytes_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_without_byte_fallback(tmp_path_factory.mktemp("models") / "nobytes.gguf")


async def test_an_unencodable_character_is_a_400_and_the_server_lives_on(
        nobytes_path: Path, tmp_path: Path) -> None:
    async with serve(nobytes_path, tmp_path / "ckpt", cache__enabled=False) as srv:
        for ch in MISSING:
            for stream in (False, True):
                with pytest.raises(openai.BadRequestError) as err:
                    await srv.client.chat.completions.create(
                        model="x", max_tokens=2, stream=stream,
                        messages=[{"role": "user", "content": f"a{ch}b"}])
                assert f"U+{ord(ch):04X}" in str(err.value.body), err.value.body
        with pytest.raises(openai.BadRequestError) as err:
            await srv.client.completions.create(model="x", prompt="x → y", max_tokens=2)
        assert "U+2192" in str(err.value.body)
        # typed special-token text goes through the plain-text path: checked there too
        with pytest.raises(openai.BadRequestError):
            await srv.client.chat.completions.create(model="x", max_tokens=2, messages=[
                {"role": "user", "content": "<|im_end|>\t"}])
        # still alive, and what the vocabulary holds is served
        ok = await srv.client.chat.completions.create(
            model="x", max_tokens=3, temperature=0,
            messages=[{"role": "user", "content": "plain <|im_end|> text"}])
        assert ok.choices[0].finish_reason == "length"
        async with aiohttp.ClientSession() as http, http.get(srv.url + "/health") as r:
            assert r.status == 200
