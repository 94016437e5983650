"""Whether a module imported before llama.cpp's libraries stops a model from loading.

``python -m tools.gpu.import_order [GGUF]``: for each module, a new process imports it,
then loads the model with every layer offloaded, and again with llama_cpp imported
first; one row each, with the exit status (-11: a segmentation fault). On a CUDA
machine (docs/gpu.md) a process that had imported ``frozenlist`` (aiohttp imports it)
before llama_cpp died in ``llama_model_load_from_file``; with llama_cpp imported first
it loaded, which is why ``statecache serve`` and the tests import the binding first.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

MODULES = ("json", "ssl", "multidict", "frozenlist", "aiohttp", "openai")
LOAD = ("from proxy.engine.binding import Model\n"
        "Model({path!r}, n_gpu_layers=-1).close()\n")


def run(code: str) -> int:
    return subprocess.run([sys.executable, "-c", code], capture_output=True,
                          timeout=120).returncode


def main() -> int:
    from tools.synth_gguf import ensure
    path = str(Path(sys.argv[1]) if len(sys.argv) > 1 else
               ensure("hybrid", Path(__file__).resolve().parents[2] / "models"))
    print("| imported before the model loads | exit status | llama_cpp imported first |")
    print("|---|---:|---:|")
    for mod in MODULES:
        later = run(f"import {mod}\n" + LOAD.format(path=path))
        first = run(f"import llama_cpp\nimport {mod}\n" + LOAD.format(path=path))
        print(f"| {mod} | {later} | {first} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
