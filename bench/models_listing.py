"""How long ``statecache models`` takes over many GGUFs: a hundred by default, each a hard
link to a real model (so every header is read in full, vocabulary and all), as the
command runs for a user: a new process, its wall time from start to exit.

    python -m bench.models_listing [--files 100]

The models are the synthetic ones of models/ (a 700-token vocabulary), SmolLM2 (49,152
tokens and its merges) and Gemma 3 (262,144 tokens); three runs: every header read
(``--no-header-cache``), the first run that keeps them, and a run that finds them kept.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from proxy.models import default_model_path, gemma_model_path

ROOT = Path(__file__).resolve().parents[1]


def _layout(folder: Path, sources: list[Path], n: int) -> None:
    for i in range(n):
        src = sources[i % len(sources)]
        os.link(src, folder / f"m{i:03d}-{src.name}")


def _time(folder: Path, home: Path, *extra: str, repeats: int = 3) -> float:
    """The median wall time of ``python -m proxy models --dir folder``, in seconds."""
    env = {**os.environ, "HOME": str(home), "HF_HUB_OFFLINE": "1"}
    for var in ("OLLAMA_MODELS", "LMSTUDIO_MODELS", "HF_HUB_CACHE", "HF_HOME"):
        env.pop(var, None)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "proxy", "models", "--dir", str(folder),
                        "--json", *extra], check=True, env=env, cwd=ROOT,
                       stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.models_listing")
    ap.add_argument("--files", type=int, default=100)
    args = ap.parse_args(argv)
    synthetic = sorted((ROOT / "models").glob("*-tiny.gguf"))
    sets = {"synthetic (700 tokens)": synthetic,
            "SmolLM2 (49,152 tokens)": [default_model_path()],
            "Gemma 3 (262,144 tokens)": [gemma_model_path()]}
    with tempfile.TemporaryDirectory(dir=ROOT / "models") as tmp:  # hard links: one fs
        print(f"{args.files} files, python -m proxy models --dir DIR --json, median of 3 "
              "runs (wall s, a new process each):")
        print(f"{'files':<26} {'every header':>13} {'first kept':>11} {'kept':>8}")
        for label, sources in sets.items():
            folder, home = Path(tmp) / label.split()[0], Path(tmp) / f"home-{label.split()[0]}"
            folder.mkdir()
            home.mkdir()
            _layout(folder, sources, args.files)
            cold = _time(folder, home, "--no-header-cache")
            first = _time(folder, home, repeats=1)
            warm = _time(folder, home)
            print(f"{label:<26} {cold:>13.3f} {first:>11.3f} {warm:>8.3f}")
        empty = Path(tmp) / "empty"
        empty.mkdir()
        print(f"{'no file (start-up alone)':<26} {_time(empty, empty):>13.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
