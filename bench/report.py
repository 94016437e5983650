"""Tables (``bench.md``), the TTFT figure (``ttft.png``) and the raw records (``bench.json``).

Derived numbers:
- new tokens of a follow-up: its prompt minus the previous request's prompt and
  reply (what the server has never seen); taken from the statecache run of the
  same session where a system reports no prompt tokens.
- re-prefilled beyond new: prefilled minus new tokens, summed over follow-ups.
- ideal TTFT: the follow-up's new tokens prefilled at the context length where
  they land by the binding alone (``bench.ideal``), plus statecache's restore
  time for that request; where bench.ideal did not run, the new tokens at the
  cold prefill rate (no-cache system, prompt tokens / TTFT, median), which
  underestimates it (a whole cold prompt averages over shorter contexts).
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import statistics
import time
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench.harness import Record
from bench.paired import table as paired_table
from bench.profile import Profile, Results
from bench.servers import ROOT
from bench.tables import md_table as _table
from bench.tables import streams as _streams

Key = tuple[str, str, str, int, int]  # model, variant, session, repeat, turn


def _med(xs: Iterable[float | None]) -> float | None:
    v = [x for x in xs if x is not None]
    return statistics.median(v) if v else None


def _fmt(x: float | None, spec: str = ".2f", unit: str = "") -> str:
    return "n/a" if x is None else f"{x:{spec}}{unit}"


def fill_new_tokens(records: list[Record]) -> None:
    """Fill ``new_tokens`` of follow-ups, repeats and edits."""
    by_agent: dict[tuple[str, str, str, str, int], list[Record]] = defaultdict(list)
    for r in records:
        by_agent[(r.system, r.model, r.variant, r.session, r.repeat)].append(r)
    known: dict[Key, int] = {}
    for (system, *_), recs in by_agent.items():
        prev: Record | None = None
        for r in recs:
            if r.kind == "repeat":
                r.new_tokens = 0
            elif prev is not None and r.prompt_tokens is not None and prev.prompt_tokens:
                base = prev.prompt_tokens + (prev.completion_tokens if r.kind == "follow" else 0)
                r.new_tokens = max(0, r.prompt_tokens - base) if r.kind == "follow" else None
            if r.kind == "follow" and r.new_tokens is not None and system == "statecache":
                known[(r.model, r.variant, r.session, r.repeat, r.turn)] = r.new_tokens
            if r.kind in ("first", "follow"):
                prev = r
    for r in records:
        if r.kind == "follow" and r.new_tokens is None:
            r.new_tokens = known.get((r.model, r.variant, r.session, r.repeat, r.turn))


def _cold_rate(records: list[Record], model: str) -> float | None:
    for system in ("no-cache", "statecache"):
        rates = [r.prompt_tokens / r.ttft_s for r in records
                 if r.model == model and r.system == system and r.prompt_tokens
                 and (system == "no-cache" or r.kind == "first") and r.ttft_s > 0]
        if rates:
            return statistics.median(rates)
    return None


def _ideal(r: Record, rate: float | None, restore: dict[Key, float]) -> float | None:
    k = (r.model, r.variant, r.session, r.repeat, r.turn)
    if r.ideal_prefill_s is not None:
        return r.ideal_prefill_s + restore.get(k, 0.0) / 1000
    if rate is None or r.new_tokens is None:
        return None
    return r.new_tokens / rate + restore.get(k, 0.0) / 1000


def _summary(records: list[Record], model: str, systems: tuple[str, ...]) -> list[str]:
    recs = [r for r in records if r.model == model and r.variant == "base"]
    follow = [r for r in recs if r.kind == "follow"]
    rate = _cold_rate(records, model)
    restore = {(r.model, r.variant, r.session, r.repeat, r.turn): r.restore_ms or 0.0
               for r in recs if r.system == "statecache"}
    med: dict[str, float | None] = {}
    rows = []
    for s in systems:
        f = [r for r in follow if r.system == s]
        if not f:
            continue
        per_rep = [statistics.median(r.ttft_s for r in f if r.repeat == k)
                   for k in sorted({r.repeat for r in f})]
        med[s] = statistics.median(r.ttft_s for r in f)
        pre = [r.prefilled for r in f]
        beyond = (sum(p - (r.new_tokens or 0) for p, r in zip(pre, f, strict=True) if p is not None)
                  if all(p is not None for p in pre) else None)
        first = _med(r.ttft_s for r in recs if r.system == s and r.kind == "first")
        rows.append([s, f"{med[s]:.3f} ({min(per_rep):.3f}–{max(per_rep):.3f})", "",
                     _fmt(first, ".3f"),
                     _fmt(sum(p or 0 for p in pre) if beyond is not None else None, ",.0f"),
                     _fmt(beyond, ",.0f"),
                     _fmt(_med(r.decode_tps for r in recs if r.system == s), ".1f"),
                     _fmt(max((r.peak_rss_kb or 0) for r in recs if r.system == s) / 1024,
                          ",.0f")])
    sc = med.get("statecache")
    for row in rows:
        m = med[row[0]]
        row[2] = "1.00" if row[0] == "statecache" else (
            f"{m / sc:.2f}" if sc and m else "n/a")
    ideal = [_ideal(r, rate, restore) for r in follow if r.system == "statecache"]
    ideal_med = _med(ideal)
    new_total = sum(r.new_tokens or 0 for r in follow if r.system == "statecache")
    measured = all(r.ideal_prefill_s is not None for r in follow if r.system == "statecache")
    rows.append([f"*ideal* (new tokens {'at their context length' if measured else 'at cold rate'}"
                 " + restore)", _fmt(ideal_med, ".3f"),
                 _fmt(ideal_med / sc if ideal_med and sc else None), "", f"{new_total:,}", "0",
                 "", ""])
    head = ["system", "median follow-up TTFT s (min–max of repeats)",
            "× statecache's (peer ÷ statecache)", "first-turn TTFT s", "prefilled (follow-ups)",
            "re-prefilled beyond new", "decode tok/s", "peak RSS MiB"]
    out = _table(head, rows)
    out.append("")
    ratios = [r.ttft_s / i for r, i in zip(
        [r for r in follow if r.system == "statecache"], ideal, strict=True) if i]
    out.append(f"Cold prefill rate (no cache): {_fmt(rate, ',.0f')} tokens/s. "
               f"statecache is {_fmt(sc / ideal_med if sc and ideal_med else None)}× the ideal "
               f"(ratio of medians; median of per-request ratios "
               f"{_fmt(_med(ratios))}×). The ideal prefills each follow-up's new tokens "
               + ("at the context length where they land with `proxy.engine.binding` alone "
                  "(`bench.ideal`)" if measured else "at the cold rate")
               + " and adds statecache's restore time.")
    out += _phases(follow)
    return out


def _phases(follow: list[Record]) -> list[str]:
    """Where statecache's follow-up TTFT goes: the engine's phases (its debug line)
    and the rest (HTTP, rendering, tokenizing, streaming the first token)."""
    recs = [(r, r.phases_ms) for r in follow if r.system == "statecache" and r.phases_ms]
    if not recs:
        return []
    rows = []
    for name in ("queue", "plan", "hand-off", "restore", "prefill", "checkpoints",
                 "engine TTFT"):
        rows.append([name + (" (in plan)" if name in ("hand-off", "restore") else "")
                     + (" (in prefill)" if name == "checkpoints" else ""),
                     _fmt(_med(ph[name] for _, ph in recs), ".1f")])
    rows.append(["prefill steps", _fmt(_med(ph["prefill steps"] for _, ph in recs), ".0f")])
    rows.append(["outside the engine (client TTFT − engine TTFT)",
                 _fmt(_med(1000 * r.ttft_s - ph["engine TTFT"] for r, ph in recs), ".1f")])
    rows.append(["ideal prefill (bench.ideal)",
                 _fmt(_med(1000 * r.ideal_prefill_s for r, _ in recs
                           if r.ideal_prefill_s is not None), ".1f")])
    rows.append(["client TTFT", _fmt(_med(1000 * r.ttft_s for r, _ in recs), ".1f")])
    return ["", f"Where statecache's follow-up TTFT goes (median ms over {len(recs)} "
            "follow-ups; the engine's `phases` debug line):", "",
            *_table(["phase", "median ms"], rows)]


def _variants(records: list[Record], model: str, systems: tuple[str, ...]) -> list[str]:
    rows = []
    picks = [("exact repeat of the last request", "base", "repeat"),
             ("edit in the middle of the history", "base", "edit"),
             ("client strips reasoning (follow-ups)", "strip", "follow"),
             ("agent + subagent at once (follow-ups)", "concurrent", "follow")]
    for label, variant, kind in picks:
        for s in systems:
            rs = [r for r in records if r.model == model and r.system == s
                  and r.variant == variant and r.kind == kind]
            if not rs:
                continue
            t = [r.ttft_s for r in rs]
            rows.append([label, s, f"{statistics.median(t):.3f} ({min(t):.3f}–{max(t):.3f})",
                         _fmt(_med(r.prompt_tokens for r in rs), ",.0f"),
                         _fmt(_med(r.prefilled for r in rs), ",.0f"), str(len(rs))])
    return _table(["variant", "system", "TTFT s median (min–max)", "prompt tokens",
                   "prefilled", "requests"], rows)


def _micro(m: dict[str, Any]) -> list[str]:
    def st(d: dict[str, float], spec: str = ".2f") -> str:
        return f"{d['median']:{spec}} ({d['min']:{spec}}–{d['max']:{spec}})"

    s, d = m["state"], m["disk"]
    rows = [["checkpoint save (Context.save, full)", st(s["save_GBps"]), "numpy copy",
             st(s["numpy_copy_GBps"])],
            ["checkpoint restore (Context.restore)", st(s["restore_GBps"]), "numpy copy",
             st(s["numpy_copy_GBps"])],
            ["disk tier write (fsync)", st(d["tier_write_GBps"]), "file write + fsync",
             st(d["file_write_GBps"])],
            ["disk tier read (digest checked)", st(d["tier_read_GBps"]), "file read",
             st(d["file_read_GBps"])]]
    out = [f"Model {m['model']}; lane state of {s['tokens']:,} tokens = "
           f"{s['bytes'] / 1e6:.1f} MB; GB/s, median (min–max).", ""]
    out += _table(["operation", "GB/s", "floor", "GB/s"], rows)
    di, pr = m["direct"], m["proxy"]
    out += ["", f"Proxy overhead, cold prompt of {di['prompt_tokens']:,} tokens:", ""]
    out += _table(["path", "TTFT s", "decode tok/s"],
                  [["proxy.engine.binding directly (no HTTP)", st(di["ttft_s"], ".3f"),
                    st(di["decode_tps"], ".1f")],
                   ["statecache over HTTP (streaming)", st(pr["ttft_s"], ".3f"),
                    st(pr["decode_tps"], ".1f")]])
    return out


def _x(v: float, spec: str) -> str:
    """``v`` formatted, or n/a where it is NaN (a rate bench.batching could not measure)."""
    return format(v, spec) if math.isfinite(v) else "n/a"


def _itl_ratio(busy: float, quiet: float) -> str:
    return f"{busy / quiet:.2f}" if quiet > 0 else "n/a"


def _batching(b: dict[str, Any]) -> list[str]:
    peers = [k for k in ("statecache", "statecache-per-token", "llama-server")
             if isinstance(b.get(k), dict) and "decode_tps" in b[k]]
    out = [f"Model {b['model']}, 4 lanes (slots), greedy. `proxy.engine.binding` decoding one "
           f"stream in a loop (no HTTP): {b['direct_decode_tps']:.1f} tokens/s (the binding "
           "column: as many lanes in one batch per step, in a loop)."]
    if b.get("interleaved"):
        n = b.get("repeats")
        runs = "single runs" if n == 1 else f"medians of {n or 'several'} repeats"
        out[0] += (" Every system runs at once, the others idle while one is measured, and "
                   f"the decode rates are {runs} that take turns (the binding's among "
                   "them).")
    if "statecache-per-token" in peers:
        out[0] += (" statecache-per-token is statecache with `server.stream_interval_ms = 0`: "
                   "each step's tokens written at once, as llama-server writes them; by "
                   "default a stream is written at most every "
                   f"{b.get('stream_interval_ms', 10):g} ms.")
    out.append("")
    binding = b.get("binding") if isinstance(b.get("binding"), dict) else None
    cols = peers + (["binding (no HTTP)"] if binding else [])
    rows = []
    for c in ("1", "2", "4"):
        rows.append([_streams(c)] + [
            f"{_x(x['decode_tps'][c], '.1f')} ({_x(x['scaling'][c], '.2f')}x)"
            for x in [b[p] for p in peers] + ([binding] if binding else [])])
    out += _table(["aggregate decode tok/s (x one stream)"] + cols, rows)
    if any("n/a" in cell for row in rows for cell in row):
        out += ["", "n/a: in no run of that system did every stream decode at once (a stream "
                "ended before the last one's first token), so there is no aggregate rate."]
    if binding:
        out += [""] + [
            f"{_streams(c)} against the binding: " + ", ".join(
                f"{p} {_x(b[p]['decode_tps'][c] / binding['decode_tps'][c], '.2f')}x"
                for p in peers)
            + "." for c in ("1", "2", "4")]
        if "statecache" in peers and "llama-server" in peers:
            sc, ls = b["statecache"]["decode_tps"], b["llama-server"]["decode_tps"]
            out += ["", "statecache against llama-server: " + ", ".join(
                f"{_streams(c)} {_x(sc[c] / ls[c], '.3f')}x" for c in ("1", "2", "4")) + "."]
        out += paired_table(b)
        gap = b.get("lane_gap")
        if isinstance(gap, dict) and gap.get("0,2"):
            out += ["", f"The binding decoding two streams in lanes 0 and 1: {gap['0,1']:.1f} "
                    f"tokens/s; in lanes 0 and 2: {gap['0,2']:.1f} "
                    f"({gap['0,2'] / gap['0,1']:.2f}x): llama.cpp puts separate lanes in one "
                    "ubatch only while their ids follow each other, so statecache keeps the "
                    "lanes that decode together in one run of ids."]
        out += [""]
    else:
        out += ["", "One stream against the binding called directly: " + ", ".join(
            f"{p} {b[p]['decode_tps']['1'] / b['direct_decode_tps']:.2f}x" for p in peers)
            + ".", ""]
    cpu = [p for p in peers if b[p].get("cpu_per_token")]
    if cpu:
        out += ["The server's CPU per token of one stream, in microseconds (Linux schedstat): "
                "in the two threads that decode, and in all its other threads (HTTP, event "
                "loop; statecache's checkpoint writers, which write the states of the streams "
                "before it), which run on the cores the decode needs; and the benchmark's "
                "client reading the stream (Python, on the same cores, as with every system):",
                ""]
        out += _table(["", *cpu], [
            ["decode threads"] + [f"{b[p]['cpu_per_token']['decode_threads_us']:,.0f}"
                                  for p in cpu],
            ["other threads"] + [f"{b[p]['cpu_per_token']['other_threads_us']:,.0f}"
                                 for p in cpu]] + ([
            ["the benchmark's client"] + [f"{b[p]['cpu_per_token']['client_us']:,.0f}"
                                          for p in cpu]]
            if all("client_us" in b[p]["cpu_per_token"] for p in cpu) else []))
        out += [""]
    rows = []
    for label, key in (("quiet p50 ms", "quiet_p50_ms"), ("quiet p95 ms", "quiet_p95_ms"),
                       ("during the long prefill p50 ms", "busy_p50_ms"),
                       ("during the long prefill p95 ms", "busy_p95_ms"),
                       ("during the long prefill p99 ms", "busy_p99_ms"),
                       ("during the long prefill, longest gap ms", "busy_max_ms"),
                       ("the stream's tokens during the long prefill", "busy_tokens"),
                       ("long prompt's TTFT s", "long_prefill_s")):
        rows.append([label] + ["n/a" if key not in b[p]['itl'] else
                               f"{b[p]['itl'][key]:.1f}" if "ms" in label else
                               f"{b[p]['itl'][key]:,}" if key == "busy_tokens" else
                               f"{b[p]['itl'][key]:.2f}" for p in peers])
    rows.append(["p95 during / quiet p95"] + [
        _itl_ratio(b[p]["itl"]["busy_p95_ms"], b[p]["itl"]["quiet_p95_ms"]) for p in peers])
    out += ["Inter-token latency of a stream while another request prefills a long prompt:", ""]
    out += _table(["", *peers], rows)
    if any(b[p]["itl"]["quiet_p95_ms"] == 0 for p in peers):
        out += ["", "A p95 of 0 ms: more than 95 in 100 tokens came in the same write as the "
                "token before them (a model that decodes many tokens per write interval)."]
    out += ["", "TTFT of a short request sent 0.2 s after a long one:", ""]
    out += _table(["", *peers], [
        ["short request TTFT s"] + [f"{b[p]['short_behind_long']['short_ttft_s']:.2f}"
                                    for p in peers],
        ["long request TTFT s"] + [f"{b[p]['short_behind_long']['long_ttft_s']:.2f}"
                                   for p in peers]])
    return out


def _subagents(sa: dict[str, Any]) -> list[str]:
    peers = [k for k in ("statecache", "llama-server") if isinstance(sa.get(k), dict)
             and "requests" in sa[k]]
    out = [f"Model {sa['model']}, 3 lanes (slots): a main agent, two subagents launched "
           "together, the main agent, two more subagents together, the main agent; one "
           "system prompt with tools.", ""]
    out += _table(["", *peers], [
        ["reused / reusable tokens"] + [f"{sa[p]['reused_over_reusable']:.3f}" for p in peers],
        ["largest miss (tokens)"] + [str(sa[p]["worst_miss_tokens"]) for p in peers],
        ["TTFT per request s"] + [" ".join(f"{r['ttft_s']:.2f}" for r in sa[p]["requests"])
                                  for p in peers]])
    return out


def plot(records: list[Record], models: list[str], systems: tuple[str, ...], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for s in systems:
            rs = [r for r in records if r.model == model and r.system == s
                  and r.variant == "base" and r.kind in ("first", "follow")]
            turns = sorted({r.turn for r in rs})
            if not turns:
                continue
            per = [[r.ttft_s for r in rs if r.turn == t] for t in turns]
            line = ax.plot(turns, [statistics.median(p) for p in per], marker="o", label=s)
            ax.fill_between(turns, [min(p) for p in per], [max(p) for p in per],
                            color=line[0].get_color(), alpha=0.15)
        ax.set_title(model)
        ax.set_xlabel("turn (base session; median of repeats, band min–max)")
        ax.set_ylabel("TTFT (s)")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(out_dir: Path, prof: Profile, systems: tuple[str, ...], res: Results) -> None:
    fill_new_tokens(res.records)
    models = [p.model.label for p in prof.parts]
    (out_dir / "bench.json").write_text(json.dumps(
        {"records": [r.to_json() for r in res.records], "notes": res.notes,
         "timings": res.timings, "micro": res.micro}, indent=1))
    plot(res.records, models, systems, out_dir / "ttft.png")
    cpu = next((ln.split(":", 1)[1].strip() for ln in
                Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name")),
               platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    lines = [f"# statecache benchmark ({prof.name})", "",
             f"`python -m bench.run{' --quick' if prof.name == 'quick' else ''}` on "
             f"{os.cpu_count()} cores ({cpu}), {res.timings.get('total', 0) / 60:.1f} min. "
             f"Base session: {prof.turns} turns × {prof.repeats} repeats (different seeds), "
             f"replies of {prof.reply_tokens} tokens, greedy, context {prof.n_ctx} per lane, "
             f"1 lane (2 for the concurrent variant). Scale: "
             + ", ".join(f"{p.model.label} ×{p.scale}" for p in prof.parts) + ".",
             "", f"llama-server: {res.llama_server or 'not requested'}.", ""]
    for model in models:
        lines += [f"## {model}", "", "### Follow-up turns", ""]
        lines += _summary(res.records, model, systems)
        lines += ["", "### Variants", ""]
        lines += _variants(res.records, model, systems)
        lines.append("")
    if res.replay:
        from bench.replay_report import section as replay_section
        lines += replay_section(res.replay)
    if res.batching:
        lines += ["## Batched steps under load", ""] + _batching(res.batching) + [""]
    if res.subagents:
        lines += ["## Subagents sharing a system prompt", ""] + _subagents(res.subagents) + [""]
    if res.speculative:
        from bench.speculative import table as speculative_table
        lines += ["## Speculative decoding", "",
                  "The default config (`auto`: adaptive prompt lookup, and the draft model "
                  "where the target has one) against `source = \"off\"`, their servers "
                  "running side by side; greedy, one stream at a time; decode tokens/s "
                  "from the first token to the last; \"vs off\" is the median of the "
                  "ratios run by run (its 95% interval: bench.paired.median_ci); "
                  "acceptance = accepted / drafted. Workloads: a prose "
                  "question (chat), a file re-emitted with one rename (code-edit), and a "
                  "file the assistant wrote two turns earlier asked for again with one "
                  "rename (re-emit).", ""] \
            + speculative_table(res.speculative) + [""]
    if res.pages:
        from bench.pages import table as pages_table
        lines += ["## A long prompt's checkpoints: whole states against KV pages", "",
                  "`bench.pages`: one prefill, a FULL checkpoint every 2,048 tokens "
                  "inserted into a pool of each layout; the ideal is the last state plus, "
                  "for every other checkpoint, what does not grow with its length; restore "
                  "is lookup + assemble + `set_data` of the deepest (median of 3; 1 in the "
                  "quick run), from disk "
                  "with the page cache dropped; \"x whole\" is pages' restore time over "
                  "whole states'.", ""] + pages_table(res.pages) + [""]
    if res.remote:
        from bench.remote import markdown

        lines += ["## Several proxies sharing a store", ""] + markdown(res.remote) + [""]
    if res.micro:
        lines += ["## Micro-benchmarks", ""] + _micro(res.micro) + [""]
    lines += ["## Wall time per part", ""]
    lines += _table(["part", "seconds"], [[k, f"{v:.0f}"] for k, v in res.timings.items()])
    if res.notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in res.notes]
    lines += ["", "![TTFT per turn](ttft.png)", ""]
    (out_dir / "bench.md").write_text("\n".join(lines))
    if prof.name == "full":  # the page the README links: the latest full run
        docs = ROOT / "docs"
        docs.mkdir(exist_ok=True)
        (docs / "benchmarks.md").write_text(
            "\n".join(lines).replace("](ttft.png)", "](benchmarks-ttft.png)")
            + f"\n_Written by `make bench` on {time.strftime('%Y-%m-%d %H:%M %Z')}._\n")
        shutil.copyfile(out_dir / "ttft.png", docs / "benchmarks-ttft.png")
