"""The agents' own requests, sent again: statecache against llama-server, side by side.

``make agents AGENTS_ARGS="--record bench/fixtures/agents"`` wrote what Claude Code, the
Codex CLI and opencode sent to statecache, request by request (tools/recorder.py). Here
each file is replayed against every system in turn, on the model it was recorded on:

- each repeat starts every system afresh (an empty cache), all at once, with the same
  model, context, batch sizes, threads and lanes (bench/servers.py);
- the requests go in their recorded order, each to one system and then to the other
  (which goes first alternates), every server idle before each one is sent;
- a request is sent as recorded (its headers and body) but for two fields: greedy, and a
  reply of one token. What is timed is the time to that reply (``ttft_s``): the prompt
  prefilled and one token sampled, whatever either server's stream sends first and
  however its reply parser holds text back. The next request carries the reply the agent
  got when it was recorded, on either system;
- statecache's own account of each request (``GET /admin/requests``: its phases and the
  time outside ``llama_decode``) is kept beside it.

    python -m bench.replay                       # every fixture, 6 repeats
    python -m bench.replay --agents codex --models smollm2 --repeats 1   # a short one
    python -m bench.replay --against main        # statecache at main beside this checkout
    python -m bench.replay --systems statecache,statecache+exact   # exact mode's cost
    python -m bench.replay --agents claude --systems statecache,statecache+swa-full,llama-server
                                                 # Gemma 3 keeping every SWA cell too
                                                 # (statecache+swa-window: a window, as set)
    python -m bench.replay --docs docs/benchmarks.md   # and its section of that page

``bench.replay_report`` makes the tables (``--json`` keeps the records).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.batching import wait_quiet
from bench.servers import LLAMA_SERVER, ROOT, THREADS, ModelSpec, Server, checkout, running
from proxy.models import default_model_path, gemma_model_path
from tools.recorder import body_bytes, read_records

FIXTURES = ROOT / "bench" / "fixtures" / "agents"
# the context each fixture was recorded with (tools/agents.py MODELS)
MODELS = {"smollm2": (8192, False), "gemma3": (32768, True)}
GENERATE = ("/v1/messages", "/v1/responses", "/v1/chat/completions", "/v1/completions")
# what statecache is told beyond its defaults: Claude Code's billing line, as
# tools/agents.py and configs/hybrid-agent.toml say (docs/cache.md)
STATECACHE_CONFIG = """
[[server.volatile]]
name = "claude-code-billing"
pattern = '(?m)^x-anthropic-billing-header:[^\\n]*\\n?'
replace = ""
"""
SENT_HEADERS_DROPPED = frozenset({"accept-encoding"})  # replies come back plain


@dataclass(slots=True, frozen=True)
class Sent:
    """One recorded request: its place, its turn's label and kind, and what to send."""

    index: int
    label: str
    kind: str  # cold | new session | follow-up | other (sent, not timed)
    method: str
    path: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    peer_body: bytes  # what llama-server gets (``for_llama_server``)


@dataclass(slots=True, frozen=True)
class Fixture:
    name: str  # <agent>-<model>
    agent: str
    model: str
    requests: tuple[Sent, ...]


@dataclass(slots=True)
class Result:
    """One request sent to one system in one repeat."""

    fixture: str
    system: str
    repeat: int
    index: int
    kind: str
    status: int
    ttft_s: float
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    server: dict[str, Any] = field(default_factory=dict)  # statecache's /admin/requests
    error: str = ""


def generates(path: str) -> bool:
    return path.startswith(GENERATE) and "count_tokens" not in path


def greedy_one_token(path: str, body: Any) -> Any:
    """The body with a reply of one token, greedy (each API's own field names)."""
    if not isinstance(body, dict) or not generates(path):
        return body
    out = dict(body)
    if path.startswith("/v1/responses"):
        out["max_output_tokens"] = 1
    else:
        out.pop("max_completion_tokens", None)
        out["max_tokens"] = 1
    out["temperature"] = 0.0
    out.pop("top_p", None)
    out.pop("top_k", None)
    return out


def _same_request(body: Any) -> str:
    """A body as the server reads its prompt: streamed or not is the same request."""
    if not isinstance(body, dict):
        return json.dumps(body, sort_keys=True)
    return json.dumps({k: v for k, v in body.items() if k != "stream"}, sort_keys=True)


def for_llama_server(path: str, body: Any) -> Any:
    """The body as llama-server gets it: Codex's namespace tools (a group of functions),
    which llama-server leaves out of the prompt (2,549 of Codex's 8,878 tokens on Gemma 3),
    as the functions they hold, in their place, as statecache reads them
    (proxy/api/responses.py): both prefill the same tools."""
    if not (path.startswith("/v1/responses") and isinstance(body, dict)
            and isinstance(body.get("tools"), list)):
        return body
    tools: list[Any] = []
    for t in body["tools"]:
        if isinstance(t, dict) and t.get("type") == "namespace" and \
                isinstance(t.get("tools"), list):
            tools += t["tools"]
        else:
            tools.append(t)
    return {**body, "tools": tools}


def kinds(records: list[dict[str, Any]]) -> list[str]:
    """Each request's kind: the first that generates is the cold first turn; the first of
    the "new session" turn starts a new conversation; every later one that generates is
    a follow-up; the rest (count_tokens, HEAD /) is sent but not timed. A request that
    repeats an earlier one of its turn (an agent's retry after its own time limit, the
    stream or not) is a "retry": left out, since an answer in time has no retry."""
    out = []
    seen_cold = seen_new = False
    sent: set[tuple[str, str]] = set()
    for r in records:
        if r["method"] != "POST" or not generates(str(r["path"])):
            out.append("other")
            continue
        key = (str(r.get("label", "")), _same_request(r.get("body")))
        if key in sent:
            out.append("retry")
            continue
        sent.add(key)
        if not seen_cold:
            seen_cold = True
            out.append("cold")
        elif r.get("label") == "new session" and not seen_new:
            seen_new = True
            out.append("new session")
        else:
            out.append("follow-up")
    return out


def load(path: Path) -> Fixture:
    name = path.name.removesuffix(".jsonl.zst")
    agent, _, model = name.partition("-")
    records = read_records(path)
    sent = []
    for i, (r, kind) in enumerate(zip(records, kinds(records), strict=True)):
        if kind == "retry":
            continue
        where = str(r["path"])
        body = greedy_one_token(where, r.get("body"))
        sent.append(Sent(i, str(r.get("label", "")), kind, str(r["method"]), where,
                         tuple((str(k), str(v)) for k, v in r.get("headers", ())
                               if str(k).lower() not in SENT_HEADERS_DROPPED),
                         body_bytes(body), body_bytes(for_llama_server(where, body))))
    return Fixture(name, agent, model, tuple(sent))


def fixtures(folder: Path, agents: list[str] | None, models: list[str] | None) -> list[Fixture]:
    out = []
    for path in sorted(folder.glob("*.jsonl.zst")):
        f = load(path)
        if (agents is None or f.agent in agents) and (models is None or f.model in models):
            out.append(f)
    return out


# ------------------------------------------------------------------------- sending ---

def _first_output(obj: dict[str, Any]) -> bool:
    """Whether a stream event carries generated output (a token's text or a tool call)."""
    t = obj.get("type")
    if isinstance(t, str):
        if t == "content_block_delta" or (t.startswith("response.") and t.endswith(".delta")):
            return True
        if t == "content_block_start":
            return (obj.get("content_block") or {}).get("type") == "tool_use"
        return t == "response.output_item.added" and \
            (obj.get("item") or {}).get("type") == "function_call"
    for ch in obj.get("choices") or ():
        d = ch.get("delta") or {}
        if d.get("content") or d.get("reasoning_content") or d.get("tool_calls") \
                or ch.get("text"):
            return True
    return False


def _usage(obj: dict[str, Any], got: dict[str, int]) -> None:
    """Prompt and cached tokens from whichever event of each API carries them."""
    u = obj.get("usage") or (obj.get("message") or {}).get("usage") or \
        (obj.get("response") or {}).get("usage")
    if not isinstance(u, dict):
        return
    if "input_tokens" in u:  # Anthropic, Responses
        cached = u.get("cache_read_input_tokens")
        if cached is None:
            cached = (u.get("input_tokens_details") or {}).get("cached_tokens")
        prompt = int(u["input_tokens"]) + (int(cached) if "cache_read_input_tokens" in u
                                           and cached else 0)
        got["prompt"] = prompt
        if cached is not None:
            got["cached"] = int(cached)
    elif "prompt_tokens" in u:
        got["prompt"] = int(u["prompt_tokens"])
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
        if cached is not None:
            got["cached"] = int(cached)


def send(url: str, req: Sent, peer: bool = False) -> tuple[int, float, dict[str, int], str]:
    """(status, seconds to the first output or the reply's end, usage, error text);
    ``peer``: llama-server's body."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=1800)
    got: dict[str, int] = {}
    try:
        t0 = time.perf_counter()
        body = req.peer_body if peer else req.body
        conn.request(req.method, req.path, body=body or None, headers=dict(req.headers))
        resp = conn.getresponse()
        first: float | None = None
        if resp.status >= 400 or "text/event-stream" not in resp.getheader("Content-Type", ""):
            data = resp.read()
            t = time.perf_counter() - t0
            with contextlib.suppress(ValueError):
                obj = json.loads(data)
                if isinstance(obj, dict):
                    _usage(obj, got)
            err = data.decode(errors="replace")[:300] if resp.status >= 400 else ""
            return resp.status, t, got, err
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            with contextlib.suppress(ValueError):
                obj = json.loads(line[5:])
                if isinstance(obj, dict):
                    if first is None and _first_output(obj):
                        first = time.perf_counter() - t0
                    _usage(obj, got)
        end = time.perf_counter() - t0
        return resp.status, min(first if first is not None else end, end), got, ""
    finally:
        conn.close()


def last_record(server: Server) -> dict[str, Any]:
    """statecache's record of the request it answered last (``GET /admin/requests``)."""
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("GET", "/admin/requests")
        recs = json.loads(conn.getresponse().read())["requests"]
    except (OSError, ValueError, KeyError):
        return {}
    finally:
        conn.close()
    gen = [r for r in recs if generates(str(r.get("path", "")))]
    return dict(gen[-1]) if gen else {}


# ------------------------------------------------------------------------- running ---

@dataclass(slots=True, frozen=True)
class Options:
    repeats: int
    lanes: int
    threads: int
    log_dir: Path
    model: Path | None = None  # every fixture on this GGUF instead of its own model
    n_ctx: int = 0  # tokens per lane instead of the recorded context


def model_spec(model: str, other: Path | None = None) -> ModelSpec:
    n_ctx, gemma = MODELS[model]
    if other is not None:  # its own template (from the GGUF)
        return ModelSpec(other.stem, other, is_gemma=False)
    path = gemma_model_path() if gemma else default_model_path()
    return ModelSpec(model, path, is_gemma=gemma)


@contextlib.contextmanager
def _systems(names: list[str], fx: Fixture, opts: Options, root: Path | None,
             repeat: int) -> Iterator[dict[str, Server]]:
    n_ctx = opts.n_ctx or (MODELS[fx.model][0] if opts.model is None
                           else max(v[0] for v in MODELS.values()))
    spec = model_spec(fx.model, opts.model)
    with contextlib.ExitStack() as stack:
        out: dict[str, Server] = {}
        for name in names:
            extra = STATECACHE_CONFIG if name.startswith("statecache") else ""
            system, _, rev = name.partition("@")  # statecache@REV: that checkout's
            model_config = ""
            if system == "statecache+exact":  # cache.exact (docs/exact.md)
                system, extra = "statecache", "exact = true\n" + extra
            elif system == "statecache+swa-window":  # model.swa_full = false (design.md 25)
                system, model_config = "statecache", "swa_full = false\n"
            elif system == "statecache+swa-full":  # every SWA cell kept (before the default)
                system, model_config = "statecache", "swa_full = true\n"
            out[name] = stack.enter_context(running(
                system, spec, n_ctx=n_ctx, lanes=opts.lanes, log_dir=opts.log_dir,
                extra_config=extra, tag=f"-{fx.name}-r{repeat}" + (f"-{rev}" if rev else ""),
                root=root if rev else None, threads=opts.threads, model_config=model_config))
        yield out


def run_fixture(fx: Fixture, names: list[str], opts: Options, root: Path | None
                ) -> list[Result]:
    out: list[Result] = []
    for rep in range(opts.repeats):
        with _systems(names, fx, opts, root, rep) as servers:
            pids = [s.proc.pid for s in servers.values()]
            for req in fx.requests:
                order = names if (req.index + rep) % 2 == 0 else list(reversed(names))
                for name in order:
                    srv = servers[name]
                    wait_quiet(pids)
                    status, t, usage, err = send(srv.url, req, peer=name == "llama-server")
                    rec = last_record(srv) if name.startswith("statecache") and \
                        req.kind != "other" else {}
                    out.append(Result(fx.name, name, rep, req.index, req.kind, status, t,
                                      usage.get("prompt", rec.get("prompt_tokens")),
                                      rec.get("cached_tokens", usage.get("cached")),
                                      rec, err))
                    if req.kind != "other":
                        print(f"  {fx.name} r{rep} #{req.index} {req.kind:<11} {name:<14} "
                              f"{status} {t:7.3f} s prompt {out[-1].prompt_tokens} cached "
                              f"{out[-1].cached_tokens}" + (f" · {err[:120]}" if err else ""),
                              flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.replay", description=__doc__.split("\n")[0])
    ap.add_argument("--fixtures", type=Path, default=FIXTURES)
    ap.add_argument("--agents", help="comma-separated: claude, codex, opencode (default: all)")
    ap.add_argument("--models", help="comma-separated: smollm2, gemma3 (default: all)")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--lanes", type=int, default=2, help="lanes (llama-server's slots)")
    ap.add_argument("--threads", type=int, default=THREADS)
    ap.add_argument("--systems", default="statecache,llama-server")
    ap.add_argument("--against", help="a git revision: its statecache runs beside this one "
                    "(named statecache@REV)")
    ap.add_argument("--model", type=Path, help="replay every fixture on this GGUF (its own "
                    "template, the largest recorded context) instead of its own model: a "
                    "hybrid's checkpoints, say")
    ap.add_argument("--n-ctx", type=int, default=0, help="tokens per lane instead of the "
                    "recorded context, within the model's training context (statecache "
                    "caps it there)")
    ap.add_argument("--json", type=Path, default=ROOT / "results" / "replay.json")
    ap.add_argument("--log-dir", type=Path, default=ROOT / "results" / "logs")
    ap.add_argument("--docs", type=Path, help="write the tables into this page "
                    "(docs/benchmarks.md) in place of the replay's section there")
    a = ap.parse_args(argv)
    names = a.systems.split(",")
    if "llama-server" in names and not LLAMA_SERVER.exists():
        print(f"bench.replay: no {LLAMA_SERVER} (bash bench/build_llama_server.sh)",
              file=sys.stderr)
        return 2
    fxs = fixtures(a.fixtures, a.agents.split(",") if a.agents else None,
                   a.models.split(",") if a.models else None)
    if not fxs:
        print(f"bench.replay: no fixtures in {a.fixtures}", file=sys.stderr)
        return 2
    opts = Options(a.repeats, a.lanes, a.threads, a.log_dir, a.model, a.n_ctx)
    results: list[Result] = []
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        root = None
        if a.against:
            root = stack.enter_context(checkout(a.against))
            names.append(f"statecache@{a.against}")
        for fx in fxs:
            print(f"== {fx.name}: {len(fx.requests)} requests, {opts.repeats} repeats",
                  flush=True)
            results += run_fixture(fx, names, opts, root)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    said = sys.argv[1:] if argv is None else argv
    command = " ".join(["python -m bench.replay", *said])
    a.json.write_text(json.dumps({
        "command": command, "systems": names, "repeats": opts.repeats, "lanes": opts.lanes,
        "threads": opts.threads, "seconds": round(time.monotonic() - t0, 1),
        "fixtures": {fx.name: {"agent": fx.agent,
                               "model": a.model.stem if a.model is not None else fx.model,
                               "requests": len(fx.requests)} for fx in fxs},
        "results": [asdict(r) for r in results]}, indent=1))
    from bench.replay_report import into_doc, table
    data = json.loads(a.json.read_text())
    if a.docs is not None:
        into_doc(a.docs, data, command)
    print("\n".join(table(data)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
