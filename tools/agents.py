"""Claude Code, the Codex CLI and opencode, pinned, against statecache: every HTTP request
they make.

``make agents`` (not part of ``make test``; it needs npm and takes minutes):

1. installs ``@anthropic-ai/claude-code``, ``@openai/codex`` and ``opencode-ai`` at the
   versions below into ``<scratch>/npm`` (npm's ``--prefix``; reused when those versions
   are there);
2. serves the bundled SmolLM2-135M-Instruct (8,192 tokens) and then Gemma 3 270M (32,768),
   each with ``statecache serve`` on a free 127.0.0.1 port and its own checkpoint directory
   and key under ``<scratch>/servers`` (emptied first; nothing in ~/.local/state);
3. in a fresh git repository (one file, one commit) per agent and model, runs each agent
   non-interactively: a first turn, a second turn of the same session (``claude -p
   --continue``, ``codex exec resume --last``, ``opencode run --continue``) and a new
   session in the same repository,
   each with a scratch HOME, telemetry, updates and error reporting off, 127.0.0.1 as the
   only server, and a time limit. Claude Code's prompt with its tools does not fit
   SmolLM2's context, so it runs on Gemma 3 only (``--claude-min-ctx``); Codex and opencode
   run on both when their prompt fits (a refusal of a first request for the context's size
   is said, not failed), Codex with its default tools, web_search included, and opencode
   with a chat-completions provider of its own config (opencode installs its plugin SDK
   from npm into its config folder when it first starts);
4. reads the server's ``GET /admin/requests`` and prints one row per request the agents
   made, by agent, model and turn: status, prompt, cached and prefilled tokens, output,
   TTFT and the miss reason or error; then what each turn 2 and new session reused.

With ``--record DIR`` every request goes through a recording proxy (tools/recorder.py)
and each agent's requests on each model are written to ``DIR/<agent>-<model>.jsonl.zst``:
the fixtures ``bench.replay`` sends again.

Exit status 1 when a request got a non-2xx status (the server's reason is printed) or a
turn reached no server, after the whole table.

    python -m tools.agents [--agents claude,codex,opencode] [--models smollm2,gemma3]
                           [--record DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proxy.models import default_model_path, gemma_model_path
from tools.recorder import Recorder, write_records

ROOT = Path(__file__).resolve().parents[1]
Request = dict[str, Any]
LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never an HTTP proxy


@dataclass(frozen=True)
class Cli:
    name: str
    package: str
    version: str
    # where the package keeps a stub that its postinstall script replaces with the native
    # binary, and that script (None: no native binary)
    native: tuple[str, str] | None = None


CLAUDE = Cli("claude", "@anthropic-ai/claude-code", "2.1.197", ("bin/claude.exe", "install.cjs"))
CODEX = Cli("codex", "@openai/codex", "0.171.0")
OPENCODE = Cli("opencode", "opencode-ai", "1.18.33", ("bin/opencode.exe", "postinstall.mjs"))
CLIS = {c.name: c for c in (CLAUDE, CODEX, OPENCODE)}
# Claude Code 2.1.197's first request is ~19,600 Gemma 3 tokens (system prompt, 24 tools,
# the agent list): below this context it is not run (--claude-min-ctx). SmolLM2's own chat
# template leaves the tools out of the prompt (~3,200 tokens then).
CLAUDE_MIN_CTX = 16_384
# Claude Code's default in -p mode is claude-opus-4-8 with the 1M-context beta, and
# `-p --continue` drops the beta, which rewrites the system prompt's model line and the
# Bash tool's description; naming the model keeps turn 2's prefix as an interactive
# session keeps it. "" lets Claude Code choose.
CLAUDE_MODEL = "claude-opus-4-8"

PROMPTS = {
    "turn 1": "What does hello.py return? Answer in one sentence.",
    "turn 2": "What is the name of the function in it?",
    "new session": "List the files in this repository.",
}
CONTEXT_REFUSAL = "this model's context is"  # proxy/api: a prompt past the context


@dataclass(frozen=True)
class ModelSpec:
    name: str
    n_ctx: int
    path: Callable[[], Path]


MODELS = {
    "smollm2": ModelSpec("smollm2", 8192, default_model_path),
    "gemma3": ModelSpec("gemma3", 32768, gemma_model_path),
}


# ---------------------------------------------------------------- the report (pure) ---

@dataclass(frozen=True)
class Step:
    """One agent invocation: its turn and when it ran (``time.time()``)."""

    agent: str
    model: str
    turn: str
    start: float
    end: float
    exit_code: int | None = 0
    timed_out: bool = False
    may_overflow: bool = False  # a refusal for the context's size is a finding, not a failure
    detail: str = ""  # the agent's last line of output


@dataclass
class ServerRun:
    """One server (one model): the agent invocations against it and what it recorded."""

    model: str
    steps: list[Step]
    requests: list[Request]
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # the server failed: exit status 1


@dataclass(frozen=True)
class Report:
    lines: list[str]
    failures: list[str]

    @property
    def exit_code(self) -> int:
        return 1 if self.failures else 0


COLUMNS = ("agent", "model", "turn", "request", "status", "prompt", "shared", "cached",
           "prefilled", "output", "TTFT", "miss / error")
RIGHT = {"status", "prompt", "shared", "cached", "prefilled", "output", "TTFT"}


def assign(steps: Sequence[Step], requests: Sequence[Request]
           ) -> list[tuple[Step | None, Request]]:
    """Each request with the last step that had started when the server recorded it (a
    request is recorded when it ends, so one cut short by a time limit still counts for its
    step); None before the first step."""
    ordered = sorted(steps, key=lambda s: s.start)
    out: list[tuple[Step | None, Request]] = []
    for req in requests:
        t = float(req.get("time") or 0.0)
        owner = None
        for step in ordered:
            if step.start <= t:
                owner = step
        out.append((owner, req))
    return out


def ok_status(req: Request) -> bool:
    return 200 <= int(req.get("status") or 0) < 300


def overflow(req: Request) -> bool:
    """Refused because the prompt does not fit the model's context."""
    return not ok_status(req) and CONTEXT_REFUSAL in str(req.get("error") or "")


def _num(value: object) -> str:
    return "-" if value is None else f"{value:,}" if isinstance(value, int) else str(value)


def _ttft(value: object) -> str:
    return "-" if not isinstance(value, int | float) else f"{value:.2f} s"


def _share(cached: object, shared: int) -> str:
    return f"{100 * float(cached or 0) / shared:.1f}%"


def _clip(text: str, n: int = 90) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


def request_cells(step: Step | None, req: Request) -> tuple[str, ...]:
    note = req.get("error") or req.get("miss") or ""
    if step is not None and step.may_overflow and overflow(req):
        note = f"does not fit: {note}"
    return (step.agent if step else "-", step.model if step else "-",
            step.turn if step else "-", f"{req.get('method', '?')} {req.get('path', '?')}",
            str(req.get("status", "?")), _num(req.get("prompt_tokens")),
            _num(req.get("shared")), _num(req.get("cached_tokens")), _num(req.get("prefilled")),
            _num(req.get("output_tokens")), _ttft(req.get("ttft_s")), _clip(str(note)))


def table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in (COLUMNS, *rows)) for i in range(len(COLUMNS))]

    def line(cells: tuple[str, ...]) -> str:
        parts = [c.rjust(w) if name in RIGHT else c.ljust(w)
                 for c, w, name in zip(cells, widths, COLUMNS, strict=True)]
        return "  ".join(parts).rstrip()

    return [line(COLUMNS), *(line(r) for r in rows)]


def _first_generation(reqs: Sequence[Request]) -> Request | None:
    """The turn's first request that carries the agent's prompt: a side request under half
    the turn's largest prompt (opencode asks for a session's title in a conversation of
    its own, first or beside it) is passed over."""
    gens = [r for r in reqs if isinstance(r.get("prompt_tokens"), int)]
    if not gens:
        return None
    largest = max(int(r["prompt_tokens"]) for r in gens)
    return next(r for r in gens if 2 * int(r["prompt_tokens"]) >= largest)


def step_line(step: Step, reqs: Sequence[Request]) -> str:
    ended = ("timed out" if step.timed_out else
             f"exit {step.exit_code}" if step.exit_code is not None else "not run")
    if (step.timed_out or step.exit_code) and step.detail:
        ended += f" ({step.detail})"
    first = _first_generation(reqs)
    reuse = (f"; first request reused {_num(first.get('cached_tokens'))} of "
             f"{_num(first.get('prompt_tokens'))} tokens" if first else "")
    if first and isinstance(first.get("shared"), int) and first["shared"] > 0:
        reuse += (f", {_share(first['cached_tokens'], first['shared'])} of the "
                  f"{_num(first['shared'])} an earlier request held")
    return (f"{step.agent} on {step.model}, {step.turn}: {ended} after "
            f"{step.end - step.start:.1f} s, {len(reqs)} request(s){reuse}")


def failure_lines(step: Step | None, reqs: Sequence[Request]) -> list[str]:
    where = f"{step.agent} on {step.model}, {step.turn}" if step else "outside any turn"
    out = []
    for req in reqs:
        if ok_status(req) or (step is not None and step.may_overflow and overflow(req)):
            continue
        out.append(f"{where}: {req.get('method')} {req.get('path')} -> {req.get('status')}: "
                   f"{req.get('error') or '(the server gave no reason)'}")
    if step is not None and not reqs:
        out.append(f"{where}: no request reached the server")
    return out


def format_report(runs: Sequence[ServerRun]) -> Report:
    """The table (one row per request, by agent, model and turn), one line per turn, the
    notes, and the failures that make the exit status 1."""
    rows: list[tuple[str, ...]] = []
    turns: list[str] = []
    failures: list[str] = []
    notes: list[str] = []
    for run in runs:
        pairs = assign(run.steps, run.requests)
        rows += [request_cells(step, req) for step, req in pairs]
        failures += failure_lines(None, [r for s, r in pairs if s is None])
        for step in run.steps:
            mine = [r for s, r in pairs if s is step]
            turns.append(step_line(step, mine))
            failures += failure_lines(step, mine)
        notes += run.notes
        failures += [f"{run.model}: {p}" for p in run.problems]
    lines = table(rows) + ["", "Turns:", *(f"  {t}" for t in turns)]
    if notes:
        lines += ["", "Notes:", *(f"  {n}" for n in notes)]
    if failures:
        lines += ["", f"FAILED: {len(failures)} problem(s):", *(f"  {f}" for f in failures)]
    else:
        lines += ["", "OK: every request got a 2xx status."]
    return Report(lines, failures)


# ------------------------------------------------------------------- the agent CLIs ---

def installed_version(prefix: Path, package: str) -> str | None:
    meta = prefix / "node_modules" / package / "package.json"
    try:
        return str(json.loads(meta.read_text())["version"])
    except (OSError, ValueError, KeyError):
        return None


def install_clis(prefix: Path, clis: Sequence[Cli]) -> dict[str, Path]:
    """npm install the pinned versions into ``prefix`` unless there; the binaries' paths."""
    missing = [c for c in clis if installed_version(prefix, c.package) != c.version]
    if missing:
        specs = [f"{c.package}@{c.version}" for c in missing]
        print(f"npm install {' '.join(specs)} into {prefix}", flush=True)
        prefix.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "install", "--prefix", str(prefix), "--save-exact",
                        "--no-audit", "--no-fund", "--loglevel", "error", *specs], check=True)
    for c in clis:
        got = installed_version(prefix, c.package)
        if got != c.version:
            raise RuntimeError(f"{c.package}: npm installed {got}, not {c.version}")
    for c in clis:
        _place_native_binary(prefix, c)
    return {c.name: prefix / "node_modules" / ".bin" / c.name for c in clis}


def _place_native_binary(prefix: Path, cli: Cli) -> None:
    """Claude Code's and opencode's postinstall scripts put the native binary over a stub;
    an npm that skips install scripts leaves the stub, so run the script here."""
    if cli.native is None:
        return
    binary, script = cli.native
    pkg = prefix / "node_modules" / cli.package
    exe = pkg / binary
    if pkg.is_dir() and exe.is_file() and exe.stat().st_size < 4096:
        subprocess.run(["node", script], cwd=pkg, check=True)


def base_env(home: Path) -> dict[str, str]:
    """A clean environment: no inherited API keys, base URLs or proxies."""
    keep = {k: os.environ[k] for k in ("PATH", "LANG", "LC_ALL", "TZ") if k in os.environ}
    home.mkdir(parents=True, exist_ok=True)
    return {**keep, "HOME": str(home), "TERM": "dumb", "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost"}


def claude_env(home: Path, port: int, max_output: int, timeout: float = 900.0
               ) -> dict[str, str]:
    return {
        **base_env(home),
        "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{port}",
        "ANTHROPIC_API_KEY": "statecache",
        "DISABLE_TELEMETRY": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_UPDATES": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DO_NOT_TRACK": "1",
        "CLAUDE_CODE_MAX_RETRIES": "2",  # default 10, with backoff
        # a request may take as long as the turn (default 600 s): a long cold prompt on a
        # busy machine
        "API_TIMEOUT_MS": str(int(timeout * 1000)),
        # default 64,000; a reply cut there is continued (3 times), then the turn ends
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(max_output),
    }


def claude_argvs(exe: Path, model: str, max_turns: int) -> dict[str, list[str]]:
    base = [str(exe), "-p", "--max-turns", str(max_turns), "--output-format", "text"]
    base += ["--model", model] if model else []
    return {"turn 1": [*base, PROMPTS["turn 1"]],
            "turn 2": [*base, "--continue", PROMPTS["turn 2"]],
            "new session": [*base, PROMPTS["new session"]]}


def codex_config(port: int, timeout: float = 900.0) -> str:
    """Codex's defaults (its web_search tool included) but for the provider, telemetry,
    update checks and the features that reach the network at start (a git clone of
    openai/plugins, api.github.com, chatgpt.com; the request is the same without them)."""
    return f"""\
model = "local"
model_provider = "statecache"
check_for_update_on_startup = false

[analytics]
enabled = false

[feedback]
enabled = false

[otel]
exporter = "none"

[features]
plugins = false
remote_plugin = false
apps = false

[model_providers.statecache]
name = "statecache"
base_url = "http://127.0.0.1:{port}/v1"
wire_api = "responses"
stream_idle_timeout_ms = {int(timeout * 1000)}
"""


def codex_env(home: Path, port: int, timeout: float = 900.0) -> dict[str, str]:
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(codex_config(port, timeout))
    return {**base_env(home), "CODEX_HOME": str(codex_home)}


def codex_argvs(exe: Path) -> dict[str, list[str]]:
    return {"turn 1": [str(exe), "exec", "--strict-config", PROMPTS["turn 1"]],
            "turn 2": [str(exe), "exec", "resume", "--strict-config", "--last",
                       PROMPTS["turn 2"]],
            "new session": [str(exe), "exec", "--strict-config", PROMPTS["new session"]]}


def opencode_config(port: int, n_ctx: int, max_output: int) -> dict[str, Any]:
    """A chat-completions provider on the server (the model's context and reply limit, which
    opencode sends as max_tokens); no sharing, no update."""
    return {
        "$schema": "https://opencode.ai/config.json",
        "autoupdate": False,
        "share": "disabled",
        "model": "statecache/local",
        "provider": {"statecache": {
            "npm": "@ai-sdk/openai-compatible",
            "name": "statecache",
            "options": {"baseURL": f"http://127.0.0.1:{port}/v1", "apiKey": "statecache"},
            "models": {"local": {"name": "local",
                                 "limit": {"context": n_ctx, "output": max_output}}},
        }},
    }


def opencode_env(home: Path, port: int, n_ctx: int, max_output: int) -> dict[str, str]:
    env = base_env(home)  # makes home
    config = home / "opencode.json"
    config.write_text(json.dumps(opencode_config(port, n_ctx, max_output), indent=2))
    return {
        **env,
        "OPENCODE_CONFIG": str(config),
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_MODELS_FETCH": "1",  # models.dev's catalogue
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
        "OPENCODE_DISABLE_SHARE": "1",
        "OPENCODE_DISABLE_CLAUDE_CODE": "1",  # no reading of ~/.claude
    }


def opencode_argvs(exe: Path) -> dict[str, list[str]]:
    return {"turn 1": [str(exe), "run", PROMPTS["turn 1"]],
            "turn 2": [str(exe), "run", "--continue", PROMPTS["turn 2"]],
            "new session": [str(exe), "run", PROMPTS["new session"]]}


def make_repo(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "hello.py").write_text('def hello():\n    return "hello"\n')
    git = ["git", "-c", "user.name=statecache", "-c", "user.email=agents@statecache.invalid",
           "-c", "init.defaultBranch=main", "-c", "commit.gpgsign=false"]
    for args in (["init", "-q"], ["add", "hello.py"], ["commit", "-q", "-m", "hello"]):
        subprocess.run([*git, *args], cwd=path, check=True)
    return path


def run_agent(argv: list[str], cwd: Path, env: dict[str, str], timeout: float,
              log: Path) -> tuple[int | None, bool]:
    """(exit status, timed out); output appended to ``log``. On time-out, the agent's
    process group gets SIGTERM, then SIGKILL."""
    with log.open("ab") as out:
        out.write(f"\n$ {' '.join(argv)}\n".encode())
        out.flush()
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout), False
        except subprocess.TimeoutExpired:
            for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
                except ProcessLookupError:
                    break
            return proc.returncode, True


def last_line(log: Path) -> str:
    """The last error line of the agent's output since its last command, else its last line."""
    text = log.read_text(errors="replace").rsplit("\n$ ", 1)[-1]
    lines = [ln for ln in text.splitlines()[1:] if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return _clip((errors or lines or [""])[-1], 100)


# ------------------------------------------------------------------------ the server ---

@dataclass
class Server:
    port: int
    log: Path
    proc: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def requests(self) -> list[Request]:
        """``GET /admin/requests``: the server's last requests, oldest first."""
        try:
            with LOCAL.open(f"{self.url}/admin/requests", timeout=30) as resp:
                return list(json.load(resp)["requests"])
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"GET /admin/requests: {e.code} {e.reason} (this server does "
                               "not list its requests)") from e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_config(spec: ModelSpec, cache: Path, max_tokens: int, timeout: float = 900.0
                  ) -> str:
    return f"""\
# written by tools/agents.py
[model]
n_ctx = {spec.n_ctx}

[server]
lanes = 2
max_tokens_default = {max_tokens}
request_timeout = {timeout}

# Claude Code's first system block is a billing line whose suffix changes with each
# session's first prompt: the rule of configs/hybrid-agent.toml (docs/cache.md, "Text
# that changes on every request") takes it out, so a new session shares the system
# prompt and tools
[[server.volatile]]
name = "claude-code-billing"
pattern = '(?m)^x-anthropic-billing-header:[^\\n]*\\n?'
replace = ""

[cache]
disk_path = {json.dumps(str(cache / "checkpoints"))}
secret_path = {json.dumps(str(cache / "secret.key"))}
"""


def statecache_command() -> list[str]:
    exe = Path(sys.executable).with_name("statecache")
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "proxy"]


def _wait_ready(server: Server, limit: float) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            break
        try:
            with LOCAL.open(f"{server.url}/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.5)
    tail = "\n".join(server.log.read_text(errors="replace").splitlines()[-20:])
    raise RuntimeError(f"statecache did not start (log {server.log}):\n{tail}")


@contextmanager
def serving(spec: ModelSpec, model: Path, workdir: Path, max_tokens: int,
            timeout: float = 900.0) -> Iterator[Server]:
    """``statecache serve`` on a free port with an empty checkpoint directory of its own;
    a request may take ``timeout`` seconds, as an agent's turn may."""
    cache = workdir / "cache"
    shutil.rmtree(workdir, ignore_errors=True)
    cache.mkdir(parents=True, mode=0o700)
    config = workdir / "config.toml"
    config.write_text(server_config(spec, cache, max_tokens, timeout))
    port = free_port()
    log = workdir / "server.log"
    argv = [*statecache_command(), "serve", "--config", str(config), "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port)]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT)
    server = Server(port, log, proc)
    try:
        _wait_ready(server, 300.0)
        yield server
    finally:
        proc.send_signal(signal.SIGTERM)  # flushes the cache and exits 0
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -------------------------------------------------------------------------- sessions ---

@dataclass(frozen=True)
class Options:
    scratch: Path
    timeout: float
    max_output: int
    max_turns: int
    claude_model: str
    claude_min_ctx: int
    record: Path | None = None  # write each agent's requests there (tools/recorder.py)


def agent_plan(agent: str, exe: Path, home: Path, port: int, n_ctx: int, opts: Options
               ) -> tuple[dict[str, str], dict[str, list[str]]]:
    if agent == CLAUDE.name:
        return (claude_env(home, port, opts.max_output, opts.timeout),
                claude_argvs(exe, opts.claude_model, opts.max_turns))
    if agent == OPENCODE.name:
        return opencode_env(home, port, n_ctx, opts.max_output), opencode_argvs(exe)
    return codex_env(home, port, opts.timeout), codex_argvs(exe)


def doesnt_fit(step: Step, requests: Sequence[Request]) -> str | None:
    """The server's refusal when every request of ``step`` was refused for the context."""
    mine = [r for s, r in assign([step], requests) if s is step]
    if mine and all(overflow(r) for r in mine):
        return str(mine[0].get("error"))
    return None


def run_session(agent: str, exe: Path, spec: ModelSpec, server: Server, opts: Options,
                run: ServerRun) -> None:
    """Turn 1, turn 2 and a new session of one agent against one server; with
    ``opts.record``, through a recording proxy whose file goes there."""
    if opts.record is None:
        _session(agent, exe, spec, server, opts, run, server.port, None)
        return
    recorder = Recorder(server.url)
    port = recorder.start()
    try:
        _session(agent, exe, spec, server, opts, run, port, recorder)
    finally:
        recorder.stop()
    path = opts.record / f"{agent}-{spec.name}.jsonl.zst"
    write_records(path, recorder.records)
    print(f"  recorded {len(recorder.records)} requests: {path}", flush=True)


def _session(agent: str, exe: Path, spec: ModelSpec, server: Server, opts: Options,
             run: ServerRun, port: int, recorder: Recorder | None) -> None:
    where = opts.scratch / "runs" / f"{agent}-{spec.name}"
    shutil.rmtree(where, ignore_errors=True)
    repo = make_repo(where / "repo")
    env, argvs = agent_plan(agent, exe, where / "home", port, spec.n_ctx, opts)
    log = where / "agent.log"
    for turn, argv in argvs.items():
        if recorder is not None:
            recorder.label = turn
        start = time.time()
        code, timed_out = run_agent(argv, repo, env, opts.timeout, log)
        step = Step(agent, spec.name, turn, start, time.time(), code, timed_out,
                    may_overflow=turn == "turn 1", detail=last_line(log))
        run.steps.append(step)
        ended = "timed out" if timed_out else f"exit {code}"
        print(f"  {agent} {turn}: {ended} in {step.end - step.start:.1f} s · {step.detail}",
              flush=True)
        refusal = doesnt_fit(step, server.requests()) if turn == "turn 1" else None
        if refusal is not None:
            note = (f"{agent}'s prompt does not fit {spec.name}'s {spec.n_ctx:,}-token "
                    f"context (server: {refusal}); its other turns are not run")
            run.notes.append(note)
            print(f"  {note}", flush=True)
            return


def run_model(spec: ModelSpec, agents: Sequence[str], exes: dict[str, Path],
              opts: Options) -> ServerRun:
    run = ServerRun(spec.name, [], [])
    model = spec.path()
    print(f"\n== {spec.name}: {model} ({spec.n_ctx:,} tokens)", flush=True)
    workdir = opts.scratch / "servers" / spec.name
    try:
        with serving(spec, model, workdir, opts.max_output, opts.timeout) as server:
            print(f"  statecache on {server.url}, log {server.log}", flush=True)
            for agent in agents:
                if agent == CLAUDE.name and spec.n_ctx < opts.claude_min_ctx:
                    note = (f"claude is not run on {spec.name}: Claude Code's prompt with its "
                            f"tools (~19,600 tokens on gemma3) does not fit its "
                            f"{spec.n_ctx:,}-token context (--claude-min-ctx 0 runs it)")
                    run.notes.append(note)
                    print(f"  {note}", flush=True)
                    continue
                run_session(agent, exes[agent], spec, server, opts, run)
            run.requests = server.requests()
    except RuntimeError as e:
        run.problems.append(str(e))
        print(f"  error: {e}", flush=True)
    return run


def _names(text: str, allowed: Sequence[str]) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(allowed)}")
    return names


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--agents", type=lambda s: _names(s, list(CLIS)), default=list(CLIS),
                    help="comma-separated, from: " + ",".join(CLIS))
    ap.add_argument("--models", type=lambda s: _names(s, list(MODELS)), default=list(MODELS),
                    help="comma-separated, from: " + ",".join(MODELS))
    ap.add_argument("--scratch", type=Path, default=ROOT / "build" / "agents",
                    help="npm prefix, servers' caches, repositories and homes")
    ap.add_argument("--timeout", type=float, default=900.0,
                    help="seconds each agent invocation may run")
    ap.add_argument("--max-output", type=int, default=32,
                    help="reply tokens: Claude Code's CLAUDE_CODE_MAX_OUTPUT_TOKENS, "
                         "opencode's output limit and the server's max_tokens_default "
                         "(Codex sends none)")
    ap.add_argument("--max-turns", type=int, default=3, help="claude --max-turns")
    ap.add_argument("--claude-model", default=CLAUDE_MODEL,
                    help="claude --model ('' for Claude Code's own choice)")
    ap.add_argument("--claude-min-ctx", type=int, default=CLAUDE_MIN_CTX,
                    help="Claude Code runs only on models with at least this context")
    ap.add_argument("--record", type=Path, default=None, metavar="DIR",
                    help="write every request each agent sends, in order, to "
                         "DIR/<agent>-<model>.jsonl.zst (bench.replay sends them again)")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    opts = Options(args.scratch.resolve(), args.timeout, args.max_output, args.max_turns,
                   args.claude_model, args.claude_min_ctx,
                   args.record.resolve() if args.record is not None else None)
    try:
        exes = install_clis(opts.scratch / "npm", [CLIS[a] for a in args.agents])
    except (OSError, subprocess.CalledProcessError, RuntimeError) as e:
        print(f"agents: cannot install the agent CLIs: {e}", file=sys.stderr)
        return 2
    for name in args.agents:
        print(f"{CLIS[name].package}@{CLIS[name].version}: {exes[name]}")
    runs = [run_model(MODELS[m], args.agents, exes, opts) for m in args.models]
    report = format_report(runs)
    print()
    print("\n".join(report.lines))
    print(f"\nlogs: {opts.scratch / 'runs'}/*/agent.log, {opts.scratch / 'servers'}/*/server.log")
    return report.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
