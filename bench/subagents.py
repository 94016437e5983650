"""An agent and its subagents sharing one system prompt, the shape of Claude Code traces:
a main agent, then two subagents launched together, the main agent's next turn, two
more subagents together, and the main agent again. Each system serves the same
requests with the same number of lanes (slots); the measure is how much of what an
earlier request held each request reused.

    python -m bench.subagents --model models/hybrid-mid.gguf --json results/subagents.json

Reusable tokens of a request: its longest common prefix with anything an earlier
request held (prompt and reply), at most its length minus one; computed with the
project's own renderer and the model's tokenizer, the same template both systems use.
Reused: the server's ``cached_tokens``.
"""

from __future__ import annotations

import argparse
import copy
import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness import Reply, stream_chat
from bench.servers import LLAMA_SERVER, ModelSpec, running
from bench.workload import make_session

SUBTASKS = ("List the test files and what each covers.", "Find where the cache is evicted.",
            "Summarise the error handling of the server.", "Check the config loader for bugs.")


def _body(messages: list[dict[str, Any]], tools: list[dict[str, Any]], n: int) -> dict[str, Any]:
    return {"model": "bench", "messages": messages, "tools": tools, "max_tokens": n,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
            "chat_template_kwargs": {"preserve_thinking": True}}


def _send(url: str, body: dict[str, Any], out: list[tuple[dict[str, Any], Reply]]) -> None:
    r = stream_chat(url, body)
    out.append((body, r))


def run_session(url: str, system: str, tools: list[dict[str, Any]], reply: int
                ) -> list[tuple[dict[str, Any], Reply]]:
    done: list[tuple[dict[str, Any], Reply]] = []
    main: list[dict[str, Any]] = [{"role": "system", "content": system},
                                  {"role": "user", "content": "Fix the failing tests."}]
    for launch in range(2):
        _send(url, _body(copy.deepcopy(main), tools, reply), done)
        main.append(done[-1][1].message(keep_reasoning=True))
        subs = [[{"role": "system", "content": system},
                 {"role": "user", "content": SUBTASKS[2 * launch + i]}] for i in range(2)]
        threads = [threading.Thread(target=_send, args=(url, _body(m, tools, reply), done))
                   for m in subs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        main.append({"role": "tool", "tool_call_id": f"call_{launch}",
                     "content": f"Subagents reported back ({launch})."})
    _send(url, _body(copy.deepcopy(main), tools, reply), done)
    return done


def reusable(model_path: Path, done: list[tuple[dict[str, Any], Reply]]) -> list[int]:
    """Per request, in the order sent: tokens an earlier request held."""
    from proxy.api.openai import parse_chat_request
    from proxy.api.render import load_chat_template, render_chat
    from proxy.engine.binding import Model

    model = Model(model_path)
    try:
        tpl = load_chat_template(model.chat_template(), bos_token="", eos_token="")

        def toks(messages: list[dict[str, Any]], tools: Any, gen: bool) -> np.ndarray:
            req = parse_chat_request({"messages": messages, "tools": tools,
                                      "chat_template_kwargs": {"preserve_thinking": True}})
            text = render_chat(tpl, req, add_generation_prompt=gen)
            return np.asarray(model.tokenize(text), dtype=np.int32)

        held: list[np.ndarray] = []
        out: list[int] = []
        for body, r in done:
            p = toks(body["messages"], body["tools"], True)
            best = 0
            for h in held:
                k = min(len(p), len(h))
                neq = np.nonzero(p[:k] != h[:k])[0]
                best = max(best, int(neq[0]) if neq.size else k)
            out.append(min(best, len(p) - 1))
            held.append(p)
            held.append(toks(body["messages"] + [r.message(keep_reasoning=True)],
                             body["tools"], False))
        return out
    finally:
        model.close()


def run_system(system: str, spec: ModelSpec, args: argparse.Namespace,
               session: Any) -> dict[str, Any]:
    with running(system, spec, n_ctx=args.n_ctx, lanes=3, log_dir=Path(args.log_dir)) as srv:
        t0 = time.monotonic()
        done = run_session(srv.url, session.system, list(session.tools), args.reply)
        wall = time.monotonic() - t0
    can = reusable(spec.path, done)
    rows: list[dict[str, Any]] = []
    for (_, r), c in zip(done, can, strict=True):
        usage = r.usage or {}
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        rows.append({"prompt": usage.get("prompt_tokens"), "cached": cached, "reusable": c,
                     "reused": min(cached, c), "ttft_s": r.ttft_s})
    reused = sum(int(x["reused"]) for x in rows)
    total = sum(int(x["reusable"]) for x in rows)
    worst = max(int(x["reusable"]) - int(x["reused"]) for x in rows)
    return {"requests": rows, "reused_over_reusable": reused / total if total else 1.0,
            "worst_miss_tokens": worst, "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.subagents")
    p.add_argument("--model", default="models/hybrid-mid.gguf")
    p.add_argument("--json", default="results/subagents.json")
    p.add_argument("--systems", default="statecache,llama-server")
    p.add_argument("--system-chars", type=int, default=4000,
                   help="system prompt with tools, in characters (tokens on synthetic models)")
    p.add_argument("--reply", type=int, default=32)
    p.add_argument("--n-ctx", type=int, default=8192)
    p.add_argument("--log-dir", default="results/logs")
    a = p.parse_args(argv)
    spec = ModelSpec(Path(a.model).stem, Path(a.model), is_gemma=False)
    scale = a.system_chars / 3000
    session = make_session(7, scale=scale)
    result: dict[str, Any] = {"model": spec.label, "date": time.strftime("%Y-%m-%d %H:%M")}
    for system in a.systems.split(","):
        if system == "llama-server" and not LLAMA_SERVER.exists():
            result[system] = {"skipped": "not built (bench/build_llama_server.sh)"}
            continue
        result[system] = run_system(system, spec, a, session)
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: (v if not isinstance(v, dict) else
                          {kk: vv for kk, vv in v.items() if kk != "requests"})
                      for k, v in result.items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
