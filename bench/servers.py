"""The systems under test, each a subprocess on a free 127.0.0.1 port.

Every system gets the same model, context per lane, batch sizes, thread count
and number of lanes (slots); caching options stay at each system's defaults
except where named. ``running()`` kills the process on the way out, also on
error.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLAMA_SERVER = ROOT / "build" / "llama-server" / "cmake" / "bin" / "llama-server"
GEMMA_TEMPLATE = ROOT / "vendor" / "templates" / "gemma3.jinja"
THREADS = os.cpu_count() or 1
N_BATCH = 512

SYSTEMS = ("statecache", "no-cache", "llama_cpp.server", "llama-server")


@dataclass(slots=True, frozen=True)
class ModelSpec:
    label: str
    path: Path
    is_gemma: bool  # no template in the GGUF: give each system a Gemma 3 template


@dataclass(slots=True)
class Server:
    system: str
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    requests: int = 0  # requests sent one at a time so far whose log lines are read back

    def peak_rss_kb(self) -> int | None:
        """VmHWM of the server process (its lifetime peak resident set)."""
        return self._status_kb("VmHWM")

    def rss_kb(self) -> int | None:
        """VmRSS of the server process (its resident set now)."""
        return self._status_kb("VmRSS")

    def _status_kb(self, key: str) -> int | None:
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith(key + ":"):
                    return int(line.split()[1])
        except OSError:
            return None
        return None

    def cpu_ns(self) -> int:
        """CPU time the server's threads have run, in ns (their schedstat), 0 if gone."""
        return sum(self.thread_cpu_ns().values())

    def thread_cpu_ns(self) -> dict[int, int]:
        """Each of the server's threads (by id) to the CPU time it has run, in ns."""
        out: dict[int, int] = {}
        try:
            for task in os.listdir(f"/proc/{self.proc.pid}/task"):
                with contextlib.suppress(OSError, ValueError, IndexError):
                    out[int(task)] = int(Path(f"/proc/{self.proc.pid}/task/{task}/schedstat")
                                         .read_text().split()[0])
        except OSError:
            return {}
        return out

    def metrics(self) -> dict[str, float]:
        """statecache's ``/metrics``: each sample's name (with its labels) to its value."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("statecache_"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _command(system: str, model: ModelSpec, port: int, n_ctx: int, lanes: int,
             scratch: Path, extra_config: str = "", extra_args: tuple[str, ...] = (),
             root: Path | None = None, threads: int = THREADS,
             binary: Path | None = None, model_config: str = "") -> list[str]:
    py = sys.executable
    if system in ("statecache", "no-cache"):
        cfg = scratch / "statecache.toml"
        cfg.write_text(
            f'[model]\npath = "{model.path}"\nn_ctx = {n_ctx}\nn_batch = {N_BATCH}\n'
            f'n_ubatch = {N_BATCH}\nthreads = {threads}\n' + model_config +
            # a fresh disk tier per start: no run may hit another run's checkpoints
            f'[cache]\ndisk_path = "{scratch / "checkpoints"}"\n' + extra_config)
        # lanes and the log level as flags, so that extra_config may hold [server] and
        # [log] tables; --verbose: per request only, the engine's phases line, which the
        # records carry
        # another checkout (``root``): its own packages, run from its folder (``-m``
        # puts that first on sys.path, before this checkout's editable install)
        entry = [py, "-m", "proxy"] if root is not None else [str(Path(py).parent / "statecache")]
        cmd = [*entry, "serve", "--config", str(cfg),
               "--host", "127.0.0.1", "--port", str(port), "--lanes", str(lanes), "--verbose"]
        return cmd + (["--no-cache"] if system == "no-cache" else []) + list(extra_args)
    if system == "llama_cpp.server":
        if lanes != 1:
            raise ValueError("llama_cpp.server has one slot")
        cmd = [py, "-m", "llama_cpp.server", "--model", str(model.path), "--host", "127.0.0.1",
               "--port", str(port), "--n_ctx", str(n_ctx), "--n_batch", str(N_BATCH),
               "--n_ubatch", str(N_BATCH), "--n_threads", str(threads),
               "--n_threads_batch", str(threads), "--cache", "true", "--verbose", "false",
               "--chat_template_kwargs", '{"preserve_thinking": true}']
        return cmd + (["--chat_format", "gemma"] if model.is_gemma else [])
    if system == "llama-server":
        # -c is the total over slots; prompt cache, cache RAM and context
        # checkpoints stay at their defaults
        cmd = [str(binary or LLAMA_SERVER), "-m", str(model.path), "--host", "127.0.0.1",
               "--port", str(port), "-c", str(n_ctx * lanes), "-np", str(lanes),
               "-b", str(N_BATCH), "-ub", str(N_BATCH), "-t", str(threads),
               "-tb", str(threads), "--jinja", "--no-webui"]
        if model.is_gemma:
            cmd += ["--chat-template-file", str(_gemma_template_for_llama_server(scratch))]
        return cmd
    raise ValueError(f"unknown system {system!r}")


_MAP_TOJSON = "(tools | map('tojson') | join('\\n'))"


# What statecache does to a conversation before Gemma 3's template sees it
# (proxy/api/inner.py), written in the template for llama-server, which would refuse the
# agents' requests ("System messages are only supported at the start of the
# conversation.", "Conversation roles must alternate"): a system message after the first
# joins the first where only system messages came before it, else becomes user text
# marked <system>...</system> (appended to the user message before it, else put before
# the user message after it, else a user message of its own); then messages of one role
# in a row are merged. A message's parts are its text joined by a line, as statecache
# joins them, and every message comes out as its role, its text and its tool calls.
_FOLD = """\
{%- macro raw_text(content) -%}
    {%- if content is string -%}{{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for item in content -%}
            {%- if not loop.first -%}{{- '\\n' -}}{%- endif -%}{{- item.text -}}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set fold = namespace(out=[], carry='', only_system=true) -%}
{%- for m in messages -%}
    {%- if m.role == 'system' and not loop.first -%}
        {%- set text = raw_text(m.content) -%}
        {%- if fold.only_system -%}
            {%- set head = raw_text(fold.out[0].content) -%}
            {%- set fold.out = [{'role': 'system',
                                 'content': (head + '\\n\\n' + text) if head else text}] -%}
        {%- elif fold.out and fold.out[-1].role == 'user' and not fold.carry -%}
            {%- set before = raw_text(fold.out[-1].content) -%}
            {%- set marked = '<system>\\n' + text + '\\n</system>' -%}
            {%- set fold.out = fold.out[:-1] + [{'role': 'user',
                'content': (before + '\\n\\n' + marked) if before else marked}] -%}
        {%- else -%}
            {%- set marked = '<system>\\n' + text + '\\n</system>' -%}
            {%- set fold.carry = (fold.carry + '\\n\\n' + marked) if fold.carry else marked -%}
        {%- endif -%}
    {%- else -%}
        {%- set one = {'role': m.role, 'content': raw_text(m.content),
                       'tool_calls': m.tool_calls or []} -%}
        {%- if fold.carry and m.role == 'user' -%}
            {%- set fold.out = fold.out + [{'role': 'user',
                'content': fold.carry + '\\n\\n' + one.content}] -%}
        {%- else -%}
            {%- if fold.carry -%}
                {%- set fold.out = fold.out + [{'role': 'user', 'content': fold.carry}] -%}
            {%- endif -%}
            {%- set fold.out = fold.out + [one] -%}
        {%- endif -%}
        {%- set fold.carry = '' -%}
        {%- if m.role != 'system' -%}{%- set fold.only_system = false -%}{%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if fold.carry -%}
    {%- set fold.out = fold.out + [{'role': 'user', 'content': fold.carry}] -%}
{%- endif -%}
{%- set runs = namespace(out=[]) -%}
{%- for m in fold.out -%}
    {%- set prev = runs.out[-1] if runs.out else none -%}
    {%- if prev and prev.role == 'user' and m.role == 'user' -%}
        {%- set pt = prev.content -%}
        {%- set runs.out = runs.out[:-1] + [{'role': 'user',
            'content': (pt + '\\n\\n' + m.content) if pt else m.content}] -%}
    {%- elif prev and prev.role == 'assistant' and m.role == 'assistant' -%}
        {%- set runs.out = runs.out[:-1] + [{'role': 'assistant',
            'content': prev.content + m.content,
            'tool_calls': prev.tool_calls + m.tool_calls}] -%}
    {%- else -%}
        {%- set runs.out = runs.out + [m] -%}
    {%- endif -%}
{%- endfor -%}
{%- set messages = runs.out -%}
"""


def _gemma_template_for_llama_server(scratch: Path) -> Path:
    """The vendored Gemma 3 template as llama.cpp's Jinja engine takes it and with the
    conversation as statecache hands it over: the tools written without
    ``map('tojson')``, which it rejects ("filter-mapping not implemented"; same output);
    system messages after the first folded and runs merged first (``_FOLD``)."""
    text = GEMMA_TEMPLATE.read_text()
    if _MAP_TOJSON not in text or "{{- bos_token -}}" not in text:
        raise RuntimeError(f"{GEMMA_TEMPLATE} changed: update bench/servers.py")
    loop = ("{%- set tl = namespace(s='') -%}{%- for t in tools -%}"
            "{%- set tl.s = tl.s + ('' if loop.first else '\\n') + (t | tojson) -%}"
            "{%- endfor -%}\n")
    text = text.replace("{%- if tools -%}\n", "{%- if tools -%}\n" + loop, 1)
    text = text.replace("{{- bos_token -}}", _FOLD + "{{- bos_token -}}", 1)
    out = scratch / "gemma3-llama-server.jinja"
    out.write_text(text.replace(_MAP_TOJSON, "tl.s"))
    return out


@contextlib.contextmanager
def checkout(rev: str) -> Iterator[Path]:
    """A worktree of this repository at git revision ``rev``, removed on the way out: the
    statecache of another commit, to run beside this checkout's (``running(root=)``)."""
    path = Path(tempfile.mkdtemp(prefix="bench-checkout-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet",
                    str(path), rev], check=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)],
                       check=False)
        shutil.rmtree(path, ignore_errors=True)


def _health_path(system: str) -> str:
    return "/v1/models" if system == "llama_cpp.server" else "/health"


@contextlib.contextmanager
def running(system: str, model: ModelSpec, *, n_ctx: int, lanes: int, log_dir: Path,
            timeout: float = 300.0, extra_config: str = "", extra_args: tuple[str, ...] = (),
            tag: str = "", root: Path | None = None, threads: int = THREADS,
            binary: Path | None = None, model_config: str = "") -> Iterator[Server]:
    """Start ``system``, wait until it answers, yield it, always kill it.
    ``extra_config``: TOML tables appended to statecache's config; ``model_config``: keys
    of its ``[model]`` table (``swa_full = false``); ``extra_args``: flags
    of ``statecache serve``; ``root``: statecache from another checkout (a worktree);
    ``threads``: its compute threads (every core by default); ``binary``: another
    llama-server build than bench/build_llama_server.sh's."""
    if root is not None and system not in ("statecache", "no-cache"):
        raise ValueError(f"{system} has no checkout of its own")
    if binary is not None and system != "llama-server":
        raise ValueError(f"{system} takes no binary")
    scratch = Path(tempfile.mkdtemp(prefix=f"bench-{system}-"))
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{system}{tag}-{model.label}-{lanes}lane-{port}.log"
    cmd = _command(system, model, port, n_ctx, lanes, scratch, extra_config, extra_args, root,
                   threads, binary, model_config)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=root or ROOT,
                                start_new_session=True)
    server = Server(system, f"http://127.0.0.1:{port}", proc, log_path)
    try:
        _wait_healthy(server, _health_path(system), timeout)
        yield server
    finally:
        _kill(proc)
        shutil.rmtree(scratch, ignore_errors=True)


def _wait_healthy(server: Server, path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            tail = server.log_text()[-2000:]
            raise RuntimeError(f"{server.system} exited with {server.proc.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(server.url + path, timeout=2.0) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{server.system} did not become healthy in {timeout:.0f} s")


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=15)


def settle(servers: list[Server], window_s: float = 0.02, idle_ns: int = 2_000_000,
           max_s: float = 3.0) -> None:
    """Wait until every server is idle (under ``idle_ns`` of CPU in ``window_s``): what
    one did after its last reply (saving, writing checkpoints to disk) must not run
    inside the next request's decode on another, on a machine of two cores."""
    end = time.monotonic() + max_s
    last = [s.cpu_ns() for s in servers]
    while time.monotonic() < end:
        time.sleep(window_s)
        now = [s.cpu_ns() for s in servers]
        if all(b - a < idle_ns for a, b in zip(last, now, strict=True)):
            return
        last = now
