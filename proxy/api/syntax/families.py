"""The tool-call syntaxes, one per family, as data: where a block of calls opens and
closes, how its calls are written, and the family's reasoning blocks. Each was read off
the family's own chat templates (vendor/templates/llama.cpp/, rendered with an
assistant message carrying calls and reasoning; docs/tool-calls.md) and checked against
canitoolcall's recorded outputs.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from proxy.api.syntax.bodies import NameThenJson, Params, json_calls, keyed_calls
from proxy.api.syntax.calls import Block, Body, RawCall, Syntax, Tools
from proxy.api.syntax.notations import (
    MINIMAX_NS,
    MinimaxM3Calls,
    XtmlCalls,
    gemma_calls,
    pythonic_calls,
)

THINK = (("<think>", "</think>"),)
S = re.DOTALL


def first_of(*bodies: Body) -> Body:
    """The calls of the first body that reads the text."""
    def read(text: str, tools: Tools | None) -> list[RawCall] | None:
        for body in bodies:
            calls = body(text, tools)
            if calls is not None:
                return calls
        return None
    return read


# <function=NAME> <parameter=KEY> value </parameter> ... </function>: Qwen3-Coder, Qwen3.5,
# Nemotron 3 Nano, StepFun 3.5, Seed-OSS. Their templates put every closer on a line of
# its own, so a value may hold "</parameter>" or "</function>" written inline; the lenient
# reading lets a parameter's closer go missing before the next parameter or the
# function's end (seen in the wild).
_FUNCTION_XML = Params(
    call=re.compile(r"\s*<function=(?P<name>[^>\n]+)>\n?(?P<inner>(?:<parameter=.*?\n"
                    r"</parameter>\s*?\n)*?)\s*</function>", S),
    param=re.compile(r"\s*<parameter=(?P<key>[^>\n]+)>\n(?P<value>(?:(?!\n<parameter=).)*?)"
                     r"\n</parameter>"
                     r"(?=\s*(?:<parameter=|\Z))", S), trim=False)
_FUNCTION_XML_LOOSE = Params(
    call=re.compile(r"\s*<function=(?P<name>[^>\n]+)>(?P<inner>.*?)(?:</function>|\Z)", S),
    param=re.compile(r"\s*<parameter=(?P<key>[^>\n]+)>(?P<value>.*?)"
                     r"(?:</parameter>|(?=<parameter=)|\Z)", S))

HERMES = Syntax(
    "hermes", (Block("<tool_call>", "</tool_call>", json_calls),), THINK,
    models="Hermes 2/3, Qwen2.5, Qwen3, QwQ, Granite 4, MiMo, Bielik, Reka, SmolLM3")

QWEN_XML = Syntax(
    "qwen3-xml",
    (Block("<tool_call>", "</tool_call>", _FUNCTION_XML, loose=_FUNCTION_XML_LOOSE),
     Block("<function=", "</function>", _FUNCTION_XML, keep_open=True,
           loose=_FUNCTION_XML_LOOSE)),
    THINK, drop=("</tool_call>",),
    models="Qwen3-Coder, Qwen3.5, Nemotron 3 Nano, StepFun 3.5")

SEED_OSS = Syntax(
    "seed-oss", (Block("<seed:tool_call>", "</seed:tool_call>", _FUNCTION_XML,
                       loose=_FUNCTION_XML_LOOSE),),
    (("<seed:think>", "</seed:think>"),), models="Seed-OSS")

_ARG_KV = re.compile(r"\s*<arg_key>(?P<key>.*?)</arg_key>\s*<arg_value>(?P<value>.*?)"
                     r"</arg_value>", S)
_GLM_CALL = re.compile(r"\s*(?P<name>[^\n<]+)(?P<inner>.*)", S)
GLM = Syntax(
    "glm", (Block("<tool_call>", "</tool_call>",
                  Params(_GLM_CALL, _ARG_KV, trim=False, closed=False),
                  loose=Params(_GLM_CALL, re.compile(
                      r"\s*<arg_key>(?P<key>.*?)</arg_key>\s*<arg_value>(?P<value>.*?)"
                      r"(?:</arg_value>|(?=<arg_key>)|\Z)", S), trim=False, closed=False)),),
    THINK, models="GLM-4.5 to 4.7, Laguna, Spark 2.5, Ling 3")

HUNYUAN = Syntax(
    "hunyuan",
    (Block("<tool_calls:opensource>", "</tool_calls:opensource>", Params(
        re.compile(r"\s*<tool_call:opensource>(?P<name>[^<\n]+)<tool_sep:opensource>"
                   r"(?P<inner>.*?)</tool_call:opensource>", S),
        re.compile(r"\s*<arg_key:opensource>(?P<key>.*?)</arg_key:opensource>\s*"
                   r"<arg_value:opensource>(?P<value>.*?)</arg_value:opensource>", S),
        trim=False)),),
    (("<think:opensource>", "</think:opensource>"),), models="Hunyuan 3")

MINIMAX = Syntax(
    "minimax-m2", (Block("<minimax:tool_call>", "</minimax:tool_call>", Params(
        re.compile(r'\s*<invoke name="(?P<name>[^"]+)">(?P<inner>.*?)</invoke>', S),
        re.compile(r'\s*<parameter name="(?P<key>[^"]+)">(?P<value>.*?)</parameter>', S))),),
    THINK, models="MiniMax-M2")

# V4.1 writes a space after the marker (<｜DSML｜ invoke ...>)
_DSML = Params(
    re.compile(r'\s*<｜DSML｜ ?invoke name="(?P<name>[^"]+)"\s*(?:/>|>(?P<inner>.*?)'
               r"</｜DSML｜ ?invoke>)", S),
    re.compile(r'\s*<｜DSML｜ ?parameter name="(?P<key>[^"]+)"'
               r'(?: string="(?P<raw>true|false)")?>(?P<value>.*?)</｜DSML｜ ?parameter>', S),
    trim=False)
DSML = Syntax(
    "deepseek-dsml",
    (Block("<｜DSML｜function_calls>", "</｜DSML｜function_calls>", _DSML),
     Block("<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>", _DSML),
     Block("<｜DSML｜ calls>", "</｜DSML｜ calls>", _DSML)),
    THINK, models="DeepSeek V3.2, V4")

DEEPSEEK = Syntax(
    "deepseek",
    (Block("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", NameThenJson(
        re.compile(r"<｜tool▁call▁begin｜>(?:function<｜tool▁sep｜>)?(?P<name>[^\n<]+)\s*"
                   r"(?:<｜tool▁sep｜>)?"), end="<｜tool▁call▁end｜>")),),
    THINK, models="DeepSeek V3, R1, V3.1")

KIMI = Syntax(
    "kimi-k2",
    (Block("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", NameThenJson(
        re.compile(r"<\|tool_call_begin\|>\s*(?P<id>(?:functions\.)?(?P<name>[^:<\s]+)"
                   r"(?::\d+)?)\s*<\|tool_call_argument_begin\|>"), end="<|tool_call_end|>",
        noise=True)),),
    THINK, models="Kimi K2")

# Kimi K3's XTML: a reply is <|open|>think<|sep|>...<|close|>think<|sep|>, then the
# response element, then the tools element; the model may open the response right away
# where its prompt opened thinking (that ends the reasoning too).
_K3 = "<|open|>{}<|sep|>", "<|close|>{}<|sep|>"
KIMI_K3 = Syntax(
    "kimi-k3",
    (Block(_K3[0].format("tools"), _K3[1].format("tools"), XtmlCalls()),),
    ((_K3[0].format("think"), _K3[1].format("think")),
     (_K3[0].format("think"), _K3[0].format("response"))),
    drop=(_K3[0].format("response"), _K3[1].format("response"), _K3[1].format("message")),
    models="Kimi K3")

_MISTRAL_V11 = NameThenJson(
    re.compile(r"(?:\[TOOL_CALLS\])?(?P<name>[^\[\s{]+)(?:\[CALL_ID\](?P<id>[^\[]*))?"
               r"\[ARGS\]"))
MISTRAL = Syntax(
    "mistral", (Block("[TOOL_CALLS]", None, first_of(json_calls, _MISTRAL_V11)),),
    (("[THINK]", "[/THINK]"), ("<think>", "</think>")),
    models="Mistral, Mistral Nemo, Devstral, Magistral, Ministral")


def _llama_builtin(text: str, tools: Tools | None) -> list[RawCall] | None:
    """``<|python_tag|>NAME.call(k=v, ...)``: Llama 3.1's built-in tools."""
    m = re.fullmatch(r"\s*([\w\-]+)\.call\((.*)\)\s*", text, S)
    if m is None:
        return None
    return pythonic_calls(f"[{m.group(1)}({m.group(2)})]", tools)


LLAMA3 = Syntax(
    "llama3",
    (Block("<|python_tag|>", None, first_of(json_calls, _llama_builtin)),
     Block("{", None, json_calls, keep_open=True, at_start=True)),
    (), models="Llama 3.1, 3.2, 3.3")

PYTHONIC = Syntax(
    "pythonic", (Block("<|python_start|>", "<|python_end|>", pythonic_calls),
                 Block("[", None, pythonic_calls, keep_open=True, at_start=True)),
    (), models="Llama 4")

LFM2 = Syntax(
    "lfm2", (Block("<|tool_call_start|>", "<|tool_call_end|>", pythonic_calls),), THINK,
    models="LFM2, LFM2.5", hints=("<|tool_list_start|>",))

COMMAND_R = Syntax(
    "command-r",
    (Block("<|START_ACTION|>", "<|END_ACTION|>", json_calls),
     Block("Action: ```json", "```", json_calls),
     Block("Action:\n```json", "```", json_calls)),
    (("<|START_THINKING|>", "<|END_THINKING|>"),),
    drop=("<|START_RESPONSE|>", "<|END_RESPONSE|>"), models="Command R, R+, R7B, Cohere 2")

FUNCTIONARY = Syntax(
    "functionary-v3.1",
    (Block("<function=", "</function>",
           NameThenJson(re.compile(r"(?P<name>[^>\n]+)>"))),
     Block("<|python_tag|>", None, first_of(json_calls, _llama_builtin))),
    (), models="Functionary v3.1")

APERTUS = Syntax(
    "apertus", (Block("<|tools_prefix|>", "<|tools_suffix|>", keyed_calls),),
    (("<|inner_prefix|>", "<|inner_suffix|>"),), models="Apertus")

GEMMA4 = Syntax(
    "gemma4", (Block("<|tool_call>", "<tool_call|>", gemma_calls),),
    (("<|channel>thought", "<channel|>"),), models="Gemma 4")

TOOL_CALLS_JSON = Syntax(
    "tool-calls-json", (Block("<tool_calls>", "</tool_calls>", json_calls),), THINK,
    models="MiniMax-M1, Apriel")

NEMOTRON_V2 = Syntax(
    "nemotron-v2", (Block("<TOOLCALL>", "</TOOLCALL>", json_calls),), THINK,
    models="Nemotron Nano v2")

SOLAR = Syntax(
    "solar", (Block("<|tool_calls|>", "<|calls|>", NameThenJson(
        re.compile(r"<\|tool_call:begin\|>(?P<id>[^<]*)<\|tool_call:name\|>(?P<name>[^<]+)"
                   r"<\|tool_call:args\|>"), end="<|tool_call:end|>")),),
    (("<|think|>", "<|end|>"),), models="Solar Open")

MINICPM = Syntax(
    "minicpm", (Block('<function name="', "</function>", Params(
        re.compile(r'<function name="(?P<name>[^"]+)">(?P<inner>.*)', S),
        re.compile(r'\s*<param name="(?P<key>[^"]+)">(?P<value>.*?)</param>', S),
        trim=False, closed=False), keep_open=True),), THINK, models="MiniCPM 5")

GIGACHAT = Syntax(
    "gigachat", (Block("<|function_call|>", "<|message_sep|>", json_calls),
                 Block("function call<|role_sep|>", "<|message_sep|>", json_calls)),
    (), drop=("<|message_sep|>",), models="GigaChat 3")

def _listed(text: str, tools: Tools | None) -> list[RawCall] | None:
    """The calls of a JSON list whose "[" is the opener's."""
    return json_calls("[" + text, tools)


FIREFUNCTION = Syntax(
    "firefunction", (Block("functools[", None, _listed),), (), models="FireFunction v2")

MINIMAX_M3 = Syntax(
    "minimax-m3",
    (Block(MINIMAX_NS + "<tool_call>", MINIMAX_NS + "</tool_call>", MinimaxM3Calls()),),
    (("<mm:think>", "</mm:think>"),), models="MiniMax M3")


def _recipient(text: str, tools: Tools | None) -> list[RawCall] | None:
    """A message header's recipient (`` to=NAME<|message|>``): no call of its own."""
    return [] if re.fullmatch(r"[\w.\-]+", text) else None


# Muse Glimmer's ATEM: messages <|start|>assistant to=RECIPIENT<|message|>BODY<|eom|>,
# reasoning to=self, the answer to=user, calls in an <atem:function_calls> body
MUSE = Syntax(
    "atem",
    (Block("<atem:function_calls>", "</atem:function_calls>", Params(
        re.compile(r'\s*<atem:invoke name="(?P<name>[^"]+)">(?P<inner>.*?)</atem:invoke>', S),
        re.compile(r'\s*<atem:parameter name="(?P<key>[^"]+)">(?P<value>.*?)'
                   r"</atem:parameter>", S), trim=False)),
     Block(" to=", "<|message|>", _recipient)),
    (("to=self<|message|>", "<|eom|>"),), drop=("<|start|>assistant", "<|eom|>"),
    models="Muse Glimmer")

# No syntax for tool calls: reasoning only (a template that renders no calls).
PLAIN = Syntax("none", (), THINK)

# In the order the probe tries them: the more specific first (GLM and Qwen's XML share
# Hermes' <tool_call> opener; a bare <function= is both Qwen's and Functionary's).
BLOCK_SYNTAXES: Sequence[Syntax] = (
    SEED_OSS, QWEN_XML, GLM, HERMES, HUNYUAN, MINIMAX, DSML, DEEPSEEK, KIMI, KIMI_K3, MISTRAL,
    LFM2, COMMAND_R, APERTUS, GEMMA4, TOOL_CALLS_JSON, NEMOTRON_V2, SOLAR, MINICPM,
    GIGACHAT, FIREFUNCTION, MINIMAX_M3, MUSE, FUNCTIONARY, LLAMA3, PYTHONIC,
)
