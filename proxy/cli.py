"""The `statecache` command: ``serve`` and ``models`` here, the storage commands from
``statecache.cli``.

The proxy loads only inside ``serve``, so ``statecache inspect`` starts at once and
works without a model; ``models`` reads GGUF headers and never loads llama.cpp.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from statecache.cli import EXIT_PROBLEMS, Command
from statecache.cli import main as storage_main


def _serve_args(s: argparse.ArgumentParser) -> None:
    """run the proxy"""
    s.add_argument("--config", metavar="FILE", help="TOML config file")
    s.add_argument("--model", metavar="MODEL",
                   help="a GGUF path, or a model name: Ollama's (qwen3.5:27b), LM Studio's "
                        "(publisher/repo[/file]) or Hugging Face's (org/repo[:quant], "
                        "downloaded if not cached); overrides model.path")
    s.add_argument("--host", help="overrides server.host")
    s.add_argument("--port", type=int, help="overrides server.port")
    s.add_argument("--lanes", type=int, help="overrides server.lanes")
    s.add_argument("--draft", metavar="PATH",
                   help="draft GGUF for speculative decoding (overrides model.draft_path)")
    s.add_argument("--speculative", choices=("off", "lookup", "draft", "auto"),
                   help="overrides speculative.source (with --draft: auto by default)")
    s.add_argument("--no-cache", action="store_true", help="disable checkpoints")
    s.add_argument("--verbose", action="store_true", help="log at debug level")


def _serve(args: argparse.Namespace) -> int:
    import sys

    from statecache.config import load_config

    flags: dict[str, object] = {
        "model.path": args.model,
        "server.host": args.host,
        "server.port": args.port,
        "server.lanes": args.lanes,
        "model.draft_path": args.draft,
        "speculative.source": args.speculative or ("auto" if args.draft else None),
        "cache.enabled": False if args.no_cache else None,
        "log.level": "debug" if args.verbose else None,
    }
    config = load_config(args.config, {k: v for k, v in flags.items() if v is not None})
    try:
        # llama.cpp's libraries before aiohttp's: on a CUDA machine a process that had
        # loaded frozenlist (aiohttp's) first died loading the model (docs/gpu.md)
        import proxy.engine.binding  # noqa: F401
        from proxy.server import serve
    except ImportError as e:
        print(f"statecache: error: the proxy is not available ({e})", file=sys.stderr)
        return EXIT_PROBLEMS
    return int(serve(config))


def _models_args(s: argparse.ArgumentParser) -> None:
    """list the models on disk: Ollama, LM Studio, the Hugging Face cache, --dir"""
    s.add_argument("--dir", metavar="DIR", type=Path, action="append", default=[],
                   help="also list the GGUFs in DIR (repeatable)")
    s.add_argument("--config", metavar="FILE",
                   help="TOML config (model.kv_budget, server.lanes, cache.ram_budget)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--no-header-cache", action="store_true",
                   help="read every header again (not ~/.cache/statecache/gguf-headers.json)")


def _models(args: argparse.Namespace) -> int:
    from proxy.models.headercache import default_path
    from proxy.models.listing import run
    from statecache.config import load_config

    cache = None if args.no_header_cache else default_path()
    return run(args.dir, load_config(args.config), args.json, cache)


COMMANDS: dict[str, Command] = {"serve": (_serve_args, _serve), "models": (_models_args, _models)}


def main(argv: list[str] | None = None) -> int:
    return storage_main(argv, COMMANDS)
