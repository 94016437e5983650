"""``make bench``: every system on every model on the same agent workload.

    python -m bench.run            # the full run (about 30 min on 2 cores), results/
    python -m bench.run --quick    # smoke run: tiny hybrid, statecache vs no cache

Writes ``results/bench.md``, ``results/ttft.png``, ``results/bench.json`` (all
records) and the servers' logs under ``results/logs/``. One server runs at a
time; each is killed when its part ends, also on error.

Sizes of the full run, chosen to fit 30 minutes on 2 cores that other jobs
share (the 0.8B-class hybrid prefills ~290 tokens/s on a quiet machine, ~80
with the other jobs of this machine running; Gemma 3 270M about the same):
sessions of 6 turns (below the 10-20 of the workload: the peers without a
usable cache re-prefill the whole history every turn, which is quadratic),
sizes scaled by 0.05 on the bench hybrid (turns 5-100 tokens; the system prompt
with the template's tool preamble is ~800 tokens) and by 0.25 on Gemma 3 270M
(~5-6 characters a token), replies of 16 tokens; the base session three times
with different seeds, each followed by an exact repeat and a mid-history edit;
the strip and concurrent variants once, 3 turns each. The peers that
re-prefill the history every turn (no cache; llama_cpp.server, whose cache
measured ~8 minutes for one 6-turn base session of the hybrid) run the base
session once, and llama_cpp.server (one slot) skips the strip and concurrent
variants. ``--turns``, ``--repeats`` and ``--scale`` change the sizes.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import replace
from pathlib import Path

from bench import report
from bench.harness import Agent, Record, statecache_log_lines
from bench.profile import Part, Profile, Results
from bench.servers import LLAMA_SERVER, ROOT, SYSTEMS, ModelSpec, Server, running
from bench.workload import Sizes, make_session

log = logging.getLogger("bench")
# Peers whose cache does not carry a session forward here: every turn costs about a
# cold prefill of the whole history, so one run of the base session already shows
# it, and three would not fit the time budget.
COLD_PEERS = ("no-cache", "llama_cpp.server")


def _gemma() -> Path:
    out = subprocess.run([sys.executable, "-m", "proxy.models", "gemma"], cwd=ROOT,
                         check=True, capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def profiles(quick: bool) -> Profile:
    models = ROOT / "models"
    if quick:
        tiny = ModelSpec("hybrid-tiny", models / "hybrid-tiny.gguf", is_gemma=False)
        return Profile("quick", (Part(tiny, 0.2),), ("statecache", "no-cache"), turns=4,
                       repeats=1, cold_repeats=1, variants=("strip", "concurrent"), reply_tokens=16,
                       n_ctx=8192, micro_model=tiny.path,
                       micro_args=("--tokens", "1024", "--prompt", "512", "--out-tokens", "32",
                                   "--repeats", "3"),
                       load_model=tiny.path,
                       batching_args=("--long", "2000", "--out-tokens", "64", "--repeats", "1",
                                      "--n-ctx", "4096"),
                       subagent_args=("--system-chars", "1500"),
                       remote_args=("--contexts", "100,300", "--repeats", "1", "--turns", "3",
                                    "--state-mib", "16"),
                       speculative_args=("--quick", "--repeats", "1"),
                       pages_args=(("--model", str(tiny.path), "--tokens", "8192",
                                    "--repeats", "1"),),
                       replay_args=("--agents", "codex", "--models", "smollm2",
                                    "--repeats", "1"))
    gemma = _gemma()
    bench = ModelSpec("hybrid-0.8B", models / "hybrid-bench.gguf", is_gemma=False)
    return Profile("full", (Part(bench, 0.05), Part(ModelSpec("gemma-3-270m", gemma, True), 0.25)),
                   SYSTEMS, turns=6, repeats=3, cold_repeats=1, variants=("strip", "concurrent"),
                   reply_tokens=16, n_ctx=8192, micro_model=gemma,
                   micro_args=("--tokens", "2048", "--prompt", "1024", "--out-tokens", "64",
                               "--repeats", "5"),
                   load_model=models / "hybrid-mid.gguf",
                   batching_args=("--long", "8000", "--out-tokens", "256", "--repeats", "15"),
                   subagent_args=("--system-chars", "6000"),
                   remote_args=("--contexts", "300,1500", "--repeats", "3", "--turns", "10",
                                "--state-mib", "256"),
                   speculative_args=("--full", "--repeats", "3"),
                   # an agent session's long first prompt: the bench hybrid, Gemma 3's SWA,
                   # and the tiny hybrid at the size of a real Claude Code request
                   pages_args=(("--model", str(bench.path), "--tokens", "16384"),
                               ("--model", str(gemma), "--tokens", "16384"),
                               ("--model", str(models / "hybrid-tiny.gguf"),
                                "--tokens", "77774")),
                   replay_args=("--repeats", "6"))


def _attach_server_facts(server: Server, agents: list[Agent], sequential: bool) -> None:
    rss = server.peak_rss_kb()
    recs = [r for a in agents for r in a.records]
    if server.system == "statecache" and sequential:
        # one Done line per request, in order: these are the ones after the server's
        # earlier requests. The client can have a reply before its lines are logged, so
        # wait (briefly) until they all are
        first, server.requests = server.requests, server.requests + len(recs)
        deadline = time.monotonic() + 10
        while len(lines := statecache_log_lines(server.log_text())) < server.requests \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        for r, line in zip(recs, lines[first:server.requests], strict=False):
            r.restore_ms = line["restore_ms"]
            r.phases_ms = line["phases"]
    for r in recs:
        r.peak_rss_kb = rss


def _session_part(prof: Profile, part: Part, system: str, res: Results, log_dir: Path) -> None:
    sizes = Sizes(reply_tokens=prof.reply_tokens)
    label = part.model.label
    with running(system, part.model, n_ctx=prof.n_ctx, lanes=1, log_dir=log_dir) as srv:
        cold = system in COLD_PEERS
        for r in range(prof.cold_repeats if cold else prof.repeats):
            s = make_session(r, scale=part.scale, sizes=sizes, n_turns=prof.turns)
            a = Agent(srv.url, system, label, "base", s, repeat=r)
            a.run()
            a.resend_last()
            a.edit_and_continue(r)
            _attach_server_facts(srv, [a], sequential=True)
            res.records += a.records
            log.info("%s %s base #%d done", label, system, r)
        if "strip" in prof.variants and system != "llama_cpp.server":
            s = make_session(100, scale=part.scale, sizes=sizes, n_turns=max(2, prof.turns // 2))
            a = Agent(srv.url, system, label, "strip", s, keep_reasoning=False)
            a.run()
            _attach_server_facts(srv, [a], sequential=True)
            res.records += a.records
    if "concurrent" not in prof.variants or system == "llama_cpp.server":
        return  # one slot: it would only serialise the two sessions
    # an agent and a subagent sharing the system prompt, at once; two lanes where possible
    lanes = 1 if system == "llama_cpp.server" else 2
    with running(system, part.model, n_ctx=prof.n_ctx, lanes=lanes, log_dir=log_dir) as srv:
        main = make_session(200, scale=part.scale, sizes=sizes, n_turns=max(2, prof.turns // 2))
        sub = make_session(201, scale=part.scale, sizes=sizes, n_turns=max(2, prof.turns // 2),
                           name="subagent", system_seed=200)
        agents = [Agent(srv.url, system, label, "concurrent", s) for s in (main, sub)]
        errors: list[BaseException] = []

        def go(a: Agent) -> None:
            try:
                a.run()
            except BaseException as e:  # re-raised below, in the main thread
                errors.append(e)

        threads = [threading.Thread(target=go, args=(a,)) for a in agents]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        _attach_server_facts(srv, agents, sequential=False)
        for a in agents:
            res.records += a.records


def _ideal(prof: Profile, part: Part, res: Results, out_dir: Path) -> None:
    """bench.ideal: each statecache follow-up's new tokens prefilled at their context
    length by the binding alone, in its own process; fills ``ideal_prefill_s``."""
    sessions: dict[tuple[str, int], list[Record]] = {}
    for r in res.records:
        if (r.system == "statecache" and r.model == part.model.label and r.variant == "base"
                and r.kind == "follow" and r.new_tokens is not None and r.prompt_tokens):
            sessions.setdefault((r.session, r.repeat), []).append(r)
    if not sessions:
        return
    recs = [sorted(rs, key=lambda r: r.turn) for rs in sessions.values()]
    shapes = [[(r.prompt_tokens - r.new_tokens, r.new_tokens) for r in rs
               if r.prompt_tokens is not None and r.new_tokens is not None] for rs in recs]
    src, path = out_dir / f"ideal-{part.model.label}-shapes.json", out_dir / "ideal.json"
    src.write_text(json.dumps(shapes))
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "bench.ideal", "--model", str(part.model.path),
                    "--shapes", str(src), "--json", str(path), "--n-ctx", str(prof.n_ctx)],
                   cwd=ROOT, check=True)
    for rs, times in zip(recs, json.loads(path.read_text()), strict=True):
        for r, t in zip(rs, times, strict=True):
            r.ideal_prefill_s = t
    res.timings[f"{part.model.label} / ideal"] = time.monotonic() - t0


def _build_llama_server(res: Results) -> bool:
    if LLAMA_SERVER.exists():
        res.llama_server = "prebuilt (bench/build_llama_server.sh skipped the build)"
        return True
    t0 = time.monotonic()
    log.info("building llama-server (bench/build_llama_server.sh) ...")
    out = subprocess.run(["bash", str(ROOT / "bench" / "build_llama_server.sh")], cwd=ROOT,
                         capture_output=True, text=True)
    dt = time.monotonic() - t0
    if out.returncode != 0 or not LLAMA_SERVER.exists():
        tail = (out.stderr or out.stdout)[-600:].strip()
        res.llama_server = f"build failed after {dt:.0f} s: {tail}"
        res.notes.append(f"llama-server left out: {res.llama_server}")
        return False
    res.llama_server = f"built in {dt:.0f} s"
    return True


def _micro(prof: Profile, res: Results, out_dir: Path) -> None:
    path = out_dir / "micro.json"
    cmd = [sys.executable, "-m", "bench.micro", "--model", str(prof.micro_model), "--json",
           str(path), "--log-dir", str(out_dir / "logs"), *prof.micro_args]
    t0 = time.monotonic()
    subprocess.run(cmd, cwd=ROOT, check=True)
    res.timings["micro"] = time.monotonic() - t0
    res.micro = json.loads(path.read_text())


def _load_parts(prof: Profile, res: Results, out_dir: Path, systems: tuple[str, ...]) -> None:
    """bench.batching and bench.subagents, each in its own process."""
    peers = ",".join(s for s in ("statecache", "llama-server") if s in systems)
    for name, args in (("batching", prof.batching_args), ("subagents", prof.subagent_args)):
        path = out_dir / f"{name}.json"
        cmd = [sys.executable, "-m", f"bench.{name}", "--model", str(prof.load_model),
               "--json", str(path), "--log-dir", str(out_dir / "logs"), "--systems", peers,
               *args]
        t0 = time.monotonic()
        try:
            subprocess.run(cmd, cwd=ROOT, check=True)
            setattr(res, name, json.loads(path.read_text()))
        except Exception as e:
            traceback.print_exc()
            res.notes.append(f"{name} failed: {e}")
        res.timings[name] = time.monotonic() - t0


def _remote(prof: Profile, res: Results, out_dir: Path) -> None:
    """bench.remote: proxies sharing a Valkey store, in its own process."""
    path = out_dir / "remote.json"
    cmd = [sys.executable, "-m", "bench.remote", "--model", str(prof.load_model), "--json",
           str(path), "--log-dir", str(out_dir / "logs"), *prof.remote_args]
    t0 = time.monotonic()
    try:
        subprocess.run(cmd, cwd=ROOT, check=True)
        res.remote = json.loads(path.read_text())
    except Exception as e:
        traceback.print_exc()
        res.notes.append(f"remote failed: {e}")
    res.timings["remote"] = time.monotonic() - t0


def _speculative(prof: Profile, res: Results, out_dir: Path) -> None:
    """bench.speculative: decode with and without drafts, in its own process."""
    path = out_dir / "speculative.json"
    cmd = [sys.executable, "-m", "bench.speculative", "--json", str(path), "--log-dir",
           str(out_dir / "logs"), *prof.speculative_args]
    t0 = time.monotonic()
    try:
        subprocess.run(cmd, cwd=ROOT, check=True)
        res.speculative = json.loads(path.read_text())
    except Exception as e:
        traceback.print_exc()
        res.notes.append(f"speculative failed: {e}")
    res.timings["speculative"] = time.monotonic() - t0


def _pages(prof: Profile, res: Results, out_dir: Path) -> None:
    """bench.pages: a long prompt's checkpoints, whole states against KV pages."""
    t0 = time.monotonic()
    for i, args in enumerate(prof.pages_args):
        path = out_dir / f"pages-{i}.json"
        cmd = [sys.executable, "-m", "bench.pages", "--every", "2048", "--repeats", "3",
               "--json", str(path), *args]
        try:
            subprocess.run(cmd, cwd=ROOT, check=True)
            res.pages.append(json.loads(path.read_text()))
        except Exception as e:
            traceback.print_exc()
            res.notes.append(f"pages {' '.join(args)} failed: {e}")
    res.timings["pages"] = time.monotonic() - t0


def _replay(prof: Profile, res: Results, out_dir: Path, systems: tuple[str, ...]) -> None:
    """bench.replay: the agents' recorded requests, statecache against llama-server."""
    path = out_dir / "replay.json"
    peers = ",".join(s for s in ("statecache", "llama-server") if s in systems)
    cmd = [sys.executable, "-m", "bench.replay", "--json", str(path), "--log-dir",
           str(out_dir / "logs"), "--systems", peers, *prof.replay_args]
    t0 = time.monotonic()
    try:
        subprocess.run(cmd, cwd=ROOT, check=True)
        res.replay = json.loads(path.read_text())
    except Exception as e:
        traceback.print_exc()
        res.notes.append(f"replay failed: {e}")
    res.timings["replay"] = time.monotonic() - t0


def run(prof: Profile, out_dir: Path, systems: tuple[str, ...], *,
        sessions_only: bool = False) -> Results:
    res = Results()
    log_dir = out_dir / "logs"
    if "llama-server" in systems and not _build_llama_server(res):
        systems = tuple(s for s in systems if s != "llama-server")
    for part in prof.parts:
        for system in systems:
            t0 = time.monotonic()
            try:
                _session_part(prof, part, system, res, log_dir)
            except Exception as e:  # one broken system must not end the benchmark
                traceback.print_exc()
                res.notes.append(f"{part.model.label} / {system}: failed: "
                                 f"{type(e).__name__}: {str(e)[:300]}")
            res.timings[f"{part.model.label} / {system}"] = time.monotonic() - t0
            log.info("%s / %s: %.0f s", part.model.label, system, time.monotonic() - t0)
        report.fill_new_tokens(res.records)
        try:
            _ideal(prof, part, res, out_dir)
        except Exception as e:
            traceback.print_exc()
            res.notes.append(f"{part.model.label} / ideal: failed: {e}")
    if sessions_only:
        return res
    if "statecache" in systems and prof.replay_args:
        _replay(prof, res, out_dir, systems)
    _load_parts(prof, res, out_dir, systems)
    if "statecache" in systems and prof.remote_args:
        _remote(prof, res, out_dir)
    if "statecache" in systems and prof.speculative_args:
        _speculative(prof, res, out_dir)
    if "statecache" in systems and prof.pages_args:
        _pages(prof, res, out_dir)
    try:
        _micro(prof, res, out_dir)
    except Exception as e:
        traceback.print_exc()
        res.notes.append(f"micro-benchmarks failed: {e}")
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.run", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="~3-minute smoke run (tiny hybrid)")
    p.add_argument("--out", default=str(ROOT / "results"), help="output folder")
    p.add_argument("--systems", help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--repeats", type=int, help="repeats of the base session")
    p.add_argument("--turns", type=int, help="turns per base session")
    p.add_argument("--scale", type=float, help="size factor for every model")
    p.add_argument("--sessions-only", action="store_true",
                   help="only the agent sessions (follow-ups, variants, ideal): no load, "
                   "remote, speculative, pages or micro parts")
    p.add_argument("--models", help="comma-separated subset of the profile's models "
                   "(their labels: hybrid-0.8B, gemma-3-270m; hybrid-tiny in --quick)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s bench: %(message)s",
                        datefmt="%H:%M:%S")
    prof = profiles(a.quick)
    if a.repeats:
        prof = replace(prof, repeats=a.repeats, cold_repeats=min(a.repeats, prof.cold_repeats))
    if a.turns:
        prof = replace(prof, turns=a.turns)
    if a.scale:
        prof = replace(prof, parts=tuple(replace(p, scale=a.scale) for p in prof.parts))
    if a.models:
        want = set(a.models.split(","))
        unknown = want - {part.model.label for part in prof.parts}
        if unknown:
            p.error(f"no such model in this profile: {', '.join(sorted(unknown))}")
        prof = replace(prof, parts=tuple(part for part in prof.parts
                                         if part.model.label in want))
    if (a.models or a.sessions_only) and prof.name == "full":
        prof = replace(prof, name="full, in part")  # not the page docs/benchmarks.md shows
    systems = tuple(a.systems.split(",")) if a.systems else prof.systems
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    res = run(prof, out, systems, sessions_only=a.sessions_only)
    res.timings["total"] = time.monotonic() - t0
    report.write(out, prof, systems, res)
    log.info("wrote %s and %s in %.0f s", out / "bench.md", out / "ttft.png",
             res.timings["total"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
