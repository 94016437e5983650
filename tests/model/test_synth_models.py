"""The synthetic GGUFs of tools/synth_gguf.py: reproducible, loadable, and
with the properties the engine's tests rely on (docs/design.md facts 3 and 5)."""

from __future__ import annotations

import ctypes
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tests.busy import THREADS
from tools import synth_gguf
from tools.synth_gguf import SPECIAL_IDS, SPECIAL_TOKENS, VOCAB, ensure

pytestmark = pytest.mark.model

TINY = ("hybrid", "norollback", "draft")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Fresh copies (never a stale models/ directory) made through ensure()."""
    out = tmp_path_factory.mktemp("synth")
    return {name: ensure(name, out) for name in TINY}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_generation_is_deterministic(models: dict[str, Path], tmp_path: Path) -> None:
    for name in TINY:
        again = synth_gguf.generate(name, tmp_path)
        assert _sha256(again) == _sha256(models[name]), name
        assert synth_gguf.stored_version(again) == synth_gguf.GENERATOR_VERSION
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_ensure_regenerates_only_when_missing_or_outdated(tmp_path: Path) -> None:
    path = ensure("draft", tmp_path)
    mtime = path.stat().st_mtime_ns
    assert ensure("draft", tmp_path) == path and path.stat().st_mtime_ns == mtime
    path.write_bytes(b"not a gguf")
    assert ensure("draft", tmp_path) == path
    assert synth_gguf.stored_version(path) == synth_gguf.GENERATOR_VERSION


# --------------------------------------------------------------------------- llama.cpp


_SILENT = None  # a log callback, kept referenced for as long as llama.cpp may call it


@pytest.fixture(scope="module")
def llama_cpp() -> Iterator[object]:
    llama_cpp = pytest.importorskip("llama_cpp")
    llama_cpp.llama_backend_init()
    global _SILENT
    if _SILENT is None:
        _SILENT = llama_cpp.llama_log_callback(lambda level, text, data: None)
    llama_cpp.llama_log_set(_SILENT, None)
    yield llama_cpp
    llama_cpp.llama_log_set(llama_cpp.llama_log_callback(), None)  # NULL: default logging


class Loaded:
    """A model plus one context, through the low-level API."""

    def __init__(self, lc: object, path: Path, n_ctx: int = 4096, n_rs_seq: int = 0) -> None:
        self.lc = lc
        params = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(str(path).encode(), params)
        assert self.model, path
        self.vocab = lc.llama_model_get_vocab(self.model)
        cp = lc.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = cp.n_ubatch = 512
        cp.n_threads = cp.n_threads_batch = THREADS
        cp.n_rs_seq = n_rs_seq
        self.ctx = lc.llama_init_from_model(self.model, cp)
        assert self.ctx, path
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)

    def close(self) -> None:
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)

    def tokenize(self, text: str, special: bool) -> list[int]:
        data = text.encode()
        buf = (self.lc.llama_token * (len(data) + 8))()
        n = self.lc.llama_tokenize(self.vocab, data, len(data), buf, len(buf), False, special)
        assert n >= 0
        return list(buf[:n])

    def detokenize(self, ids: list[int]) -> str:
        arr = (self.lc.llama_token * len(ids))(*ids)
        buf = ctypes.create_string_buffer(len(ids) * 8 + 16)
        n = self.lc.llama_detokenize(self.vocab, arr, len(ids), buf, len(buf), False, False)
        assert n >= 0
        return buf.raw[:n].decode("utf-8")

    def decode(self, ids: list[int]) -> np.ndarray:
        """Decode `ids` (in 512-token batches); return the last token's logits."""
        for i in range(0, len(ids), 512):
            chunk = ids[i : i + 512]
            arr = (self.lc.llama_token * len(chunk))(*chunk)
            assert self.lc.llama_decode(self.ctx, self.lc.llama_batch_get_one(arr, len(chunk))) == 0
        ptr = self.lc.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()


@pytest.fixture
def load(llama_cpp: object) -> Iterator[object]:
    opened: list[Loaded] = []

    def _load(path: Path, **kw: int) -> Loaded:
        opened.append(Loaded(llama_cpp, path, **kw))
        return opened[-1]

    yield _load
    for m in reversed(opened):
        m.close()


# hybrid, recurrent, n_rs_seq kept when 4 is requested
EXPECTED = {"hybrid": (True, False, 4), "norollback": (True, False, 0), "draft": (False, False, 0)}


@pytest.mark.parametrize("name", TINY)
def test_loads_with_expected_memory_kind(
    name: str, models: dict[str, Path], load, llama_cpp
) -> None:
    m = load(models[name], n_ctx=512, n_rs_seq=4)
    hybrid, recurrent, n_rs_seq = EXPECTED[name]
    assert llama_cpp.llama_model_is_hybrid(m.model) is hybrid
    assert llama_cpp.llama_model_is_recurrent(m.model) is recurrent
    # docs/design.md fact 5: qwen35 keeps n_rs_seq snapshots, jamba is clamped to 0.
    assert llama_cpp.llama_n_rs_seq(m.ctx) == n_rs_seq
    assert m.n_vocab == VOCAB.size
    assert llama_cpp.llama_vocab_eos(m.vocab) == SPECIAL_IDS["<|im_end|>"]
    assert not llama_cpp.llama_vocab_get_add_bos(m.vocab)


def test_norollback_cannot_roll_back(models: dict[str, Path], load, llama_cpp) -> None:
    for name, can in (("hybrid", True), ("norollback", False)):
        m = load(models[name], n_ctx=512, n_rs_seq=4)
        m.decode(list(range(300, 364)))
        mem = llama_cpp.llama_get_memory(m.ctx)
        assert llama_cpp.llama_memory_seq_rm(mem, 0, 62, -1) is can, name


@pytest.mark.parametrize("name", TINY)
def test_special_tokens_are_single_ids(name: str, models: dict[str, Path], load) -> None:
    m = load(models[name], n_ctx=256)
    for text, _ in SPECIAL_TOKENS:
        assert m.tokenize(text, special=True) == [SPECIAL_IDS[text]], text
    # Plain characters are one token each, spaces included.
    text = "Hello, wörld!\n\tΩ 的"
    assert len(m.tokenize(text, special=False)) == len(text)


def test_generated_text_round_trips(models: dict[str, Path], load) -> None:
    """docs/design.md fact 3: 200 greedy tokens, detokenized and re-tokenized, give
    the same ids; no special or byte token is ever emitted."""
    m = load(models["hybrid"], n_ctx=4096)
    rng = np.random.default_rng(0)
    text = "".join(rng.choice(list("abcdefgh ijklm,.\nnopqrstuvwxyz")) for _ in range(2000))
    prompt = m.tokenize(text, special=False)
    assert len(prompt) == 2000
    logits = m.decode(prompt)
    out: list[int] = []
    for _ in range(200):
        assert np.isfinite(logits).all()
        out.append(int(np.argmax(logits)))
        logits = m.decode(out[-1:])
    assert all(VOCAB.types[t] == 1 for t in out)  # NORMAL only
    assert len(set(out)) > 20, "greedy output should vary"
    assert m.tokenize(m.detokenize(out), special=False) == out


@pytest.mark.parametrize("name", ("norollback", "draft"))
def test_other_models_decode_finite_and_varied(name: str, models: dict[str, Path], load) -> None:
    m = load(models[name], n_ctx=1024)
    logits = m.decode(list(range(300, 800)))
    out: list[int] = []
    for _ in range(50):
        assert np.isfinite(logits).all()
        out.append(int(np.argmax(logits)))
        logits = m.decode(out[-1:])
    assert all(VOCAB.types[t] == 1 for t in out)
    assert len(set(out)) > 5


def test_embedded_template_is_the_vendored_one(models: dict[str, Path]) -> None:
    import gguf

    for name in TINY:
        field = gguf.GGUFReader(models[name]).get_field("tokenizer.chat_template")
        assert field is not None and field.contents() == synth_gguf.chat_template()


# --------------------------------------------------------------------------- template


def _env(**options: bool) -> ImmutableSandboxedEnvironment:
    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(**options)
    env.filters["tojson"] = lambda value, **_: json.dumps(value, ensure_ascii=False)
    env.globals["raise_exception"] = raise_exception
    return env


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
     "tool_calls": [{"id": "a", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "a", "content": "18°C"},
    {"role": "assistant", "content": "Sunny, 18°C.", "reasoning_content": "Done."},
    {"role": "user", "content": [{"type": "text", "text": "And Rome?"}]},
    {"role": "assistant", "content": "Checking.", "reasoning_content": "\nAgain.\n",
     "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
                    {"function": {"name": "get_weather", "arguments": {"city": "Roma"}}}]},
    {"role": "tool", "content": "21°C"},
    {"role": "tool", "content": "20°C"},
]

HEADER = (
    "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist"
    " with the user query.\n\nYou are provided with function signatures within <tools></tools>"
    ' XML tags:\n<tools>\n{"type": "function", "function": {"name": "get_weather", "parameters":'
    ' {"type": "object", "properties": {"city": {"type": "string"}}}}}\n</tools>\n\nFor each'
    " function call, return a json object with function name and arguments within"
    ' <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments":'
    " <args-json-object>}\n</tool_call><|im_end|>\n"
    "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
)
FIRST_CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    "<|im_end|>\n"
)
MIDDLE = (
    "<|im_start|>user\n<tool_response>\n18°C\n</tool_response><|im_end|>\n"
)
TAIL = (
    "<|im_start|>user\nAnd Rome?<|im_end|>\n"
    "<|im_start|>assistant\n<think>\nAgain.\n</think>\n\nChecking.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Roma"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\n21°C\n</tool_response>\n"
    "<tool_response>\n20°C\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
)


def _render(env: ImmutableSandboxedEnvironment, messages: list[dict], **kw: object) -> str:
    return env.from_string(synth_gguf.chat_template()).render(messages=messages, **kw)


@pytest.mark.parametrize("options", [{}, {"trim_blocks": True, "lstrip_blocks": True,
                                          "keep_trailing_newline": True}])
def test_template_renders_tools_calls_reasoning_results(options: dict[str, bool]) -> None:
    env = _env(**options)
    plain = _render(env, CONVERSATION, tools=TOOLS, add_generation_prompt=True)
    base = (HEADER + "<|im_start|>assistant\n" + FIRST_CALL + MIDDLE
            + "<|im_start|>assistant\nSunny, 18°C.<|im_end|>\n" + TAIL)
    # a thinking model: the generation prompt opens the think block
    assert plain == base + "<think>\n"

    kept = _render(env, CONVERSATION, tools=TOOLS, add_generation_prompt=True,
                   preserve_thinking=True)
    assert kept == (HEADER + "<|im_start|>assistant\n<think>\nUse the tool.\n</think>\n\n"
                    + FIRST_CALL + MIDDLE
                    + "<|im_start|>assistant\n<think>\nDone.\n</think>\n\nSunny, 18°C.<|im_end|>\n"
                    + TAIL + "<think>\n")

    no_think = _render(env, CONVERSATION, tools=TOOLS, add_generation_prompt=True,
                       enable_thinking=False)
    assert no_think == base + "<think>\n\n</think>\n\n"


def test_template_plain_chat_and_think_in_content() -> None:
    env = _env()
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "<think>\nhm\n</think>\n\nHello"},
        {"role": "user", "content": "bye"},
    ]
    assert _render(env, messages) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
        "<|im_start|>user\nbye<|im_end|>\n"
    )
    # After the last user query the reasoning stays; the last assistant turn
    # always carries a (possibly empty) think block.
    assert _render(env, messages[:2]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nhm\n</think>\n\nHello<|im_end|>\n"
    )
    assert _render(env, [*messages[:1], {"role": "assistant", "content": "Yo"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nYo<|im_end|>\n"
    )
    with pytest.raises(TemplateError):
        _render(env, [{"role": "robot", "content": "x"}])
