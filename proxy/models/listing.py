"""``statecache models``: the models already on disk (Ollama, LM Studio, the Hugging Face
cache, ``--dir`` folders) and what each would be here: its memory kind, the context
``model.kv_budget`` gives a lane, the bytes of its states, how many 32K-token
conversations ``cache.ram_budget`` keeps warm, its template's tool-call syntax.

Headers only (``header``, ``footprint``): no model is loaded. Figures as docs/models.md
defines them; a file that cannot be read is a row with its error, never a traceback.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from proxy.models import folder, hfcache, lmstudio, ollama
from proxy.models.footprint import footprint
from proxy.models.gotemplate import jinja_for
from proxy.models.header import BadGGUF, Header
from proxy.models.headercache import HeaderCache
from proxy.models.places import Found, Scan
from proxy.models.toolsyntax import tool_syntax
from statecache.budgets import lane_context, warm_conversations
from statecache.config import Config
from statecache.sizes import format_size

CONVERSATION = 32768  # tokens of the conversation the warm count is for


@dataclass(slots=True, frozen=True)
class Budgets:
    kv_budget: int
    lanes: int
    ram_budget: int

    @classmethod
    def of(cls, cfg: Config) -> Budgets:
        return cls(cfg.model.kv_budget, cfg.server.lanes, cfg.cache.ram_budget)


def scans(dirs: Iterable[Path]) -> list[Scan]:
    return [ollama.scan(), lmstudio.scan(), hfcache.scan(), *(folder.scan(d) for d in dirs)]


def template_of(f: Found, h: Header) -> tuple[str, str]:
    """The Jinja source the server would render with, and where it comes from."""
    if h.chat_template:
        return h.chat_template, "gguf"
    mapped = jinja_for(f.template) if f.template else None
    if mapped is not None:
        return mapped.read_text(encoding="utf-8"), f"ollama layer as {mapped.name}"
    return "", "ollama layer, no known format" if f.template else "none"


def row(f: Found, headers: HeaderCache, b: Budgets) -> dict[str, Any]:
    out: dict[str, Any] = {"name": f.qualified, "source": f.source, "file": str(f.path),
                           "size": f.size, "parts": f.parts, "note": f.note}
    try:
        h = headers.header(f.path)
        fp = footprint(h)
    except (BadGGUF, ValueError) as e:
        return {**out, "error": str(e)}
    except OSError as e:
        return {**out, "error": f"{f.path}: {e.strerror or e}"}
    source, origin = template_of(f, h)
    try:
        context: int | None = lane_context(fp.training_context, fp.kv_bytes_per_token,
                                           b.kv_budget, b.lanes)[0]
    except ValueError:
        context = None  # the budget holds under 512 tokens a lane
    conversation = fp.conversation_bytes(CONVERSATION)
    return {**out, "architecture": fp.architecture, "memory": fp.kind,
            "layers": {"attention": fp.attention_layers, "swa": fp.swa_layers,
                       "recurrent": fp.recurrent_layers, "all": fp.n_layer},
            "n_swa": fp.n_swa, "training_context": fp.training_context,
            "context": context, "kv_bytes_per_token": fp.kv_bytes_per_token,
            "recurrent_bytes": fp.recurrent_bytes, "conversation_bytes": conversation,
            "warm_conversations": warm_conversations(b.ram_budget, conversation),
            "template": origin, "tool_syntax": tool_syntax(source)}


def report(dirs: Iterable[Path], b: Budgets, cache: Path | None) -> dict[str, Any]:
    """Every model found and the places looked in, as ``--json`` prints it."""
    headers = HeaderCache(cache)
    places, rows = [], []
    for s in scans(dirs):
        places.append({"source": s.source, "root": str(s.root), "exists": s.exists,
                       "models": len(s.found), "problems": s.problems})
        rows += [row(f, headers, b) for f in s.found]
    headers.save()
    return {"budgets": {"kv_budget": b.kv_budget, "lanes": b.lanes,
                        "ram_budget": b.ram_budget, "conversation_tokens": CONVERSATION},
            "places": places, "models": rows}


def _cells(r: dict[str, Any]) -> tuple[str, ...]:
    if "error" in r:
        return (r["name"], format_size(r["size"]), "-", "error", "-", "-", "-", "-", "-", "-",
                r["file"])
    ctx = f"{r['context']:,}" if r["context"] is not None else "<512"
    return (r["name"], format_size(r["size"]), r["architecture"], r["memory"],
            f"{r['training_context']:,}", ctx, format_size(r["kv_bytes_per_token"]),
            format_size(r["recurrent_bytes"]) if r["recurrent_bytes"] else "-",
            f"{r['warm_conversations']:,}", r["tool_syntax"], r["file"])


HEAD = ("NAME", "SIZE", "ARCH", "MEMORY", "TRAINED", "CONTEXT", "KV/TOKEN", "STATE",
        "WARM@32K", "TOOLS", "FILE")


def print_table(rep: dict[str, Any], out: TextIO) -> None:
    b = rep["budgets"]
    lines = [HEAD, *(_cells(r) for r in rep["models"])]
    widths = [max(len(line[i]) for line in lines) for i in range(len(HEAD))]
    for line in lines:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip(),
              file=out)
    print(f"{len(rep['models'])} model(s). CONTEXT: tokens per lane that model.kv_budget "
          f"{format_size(b['kv_budget'])} over {b['lanes']} lanes allows; STATE: recurrent "
          f"state per checkpoint; WARM@32K: conversations of {b['conversation_tokens']:,} "
          f"tokens cache.ram_budget {format_size(b['ram_budget'])} keeps (docs/models.md)",
          file=out)
    for r in rep["models"]:
        for what in ("error", "note"):
            if r.get(what):
                print(f"{r['name']}: {r[what]}", file=out)
    for p in rep["places"]:
        state = f"{p['models']} model(s)" if p["exists"] else "not there"
        print(f"looked in {p['source']}: {p['root']} ({state})", file=out)
        for problem in p["problems"]:
            print(f"  {problem}", file=out)


def run(dirs: list[Path], cfg: Config, as_json: bool, cache: Path | None,
        out: TextIO | None = None) -> int:
    out = out or sys.stdout
    rep = report(dirs, Budgets.of(cfg), cache)
    if as_json:
        json.dump(rep, out, indent=2)
        out.write("\n")
    else:
        print_table(rep, out)
    return 0
