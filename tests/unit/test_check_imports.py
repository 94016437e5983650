"""tools/check_imports.py: each layering rule on small trees, and the repository itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.check_imports import ROOT, imports, main, sources, violations

# A tree that keeps every rule: the engine's binding (as a module or a package), the
# engine's contract, an API module, storage, a tool and a bench script.
CLEAN = {
    "statecache/__init__.py": "",
    "statecache/pages.py": "import numpy as np\n",
    "statecache/pool.py": "from statecache.pages import np\nfrom . import pages\n",
    "statecache/formats/__init__.py": "",
    "statecache/formats/diskfmt.py": "from statecache.pages import np\n",
    "statecache/tiers/__init__.py": "",
    "statecache/tiers/disk.py": "from statecache.formats import diskfmt\n",
    "statecache/tiers/ram.py": "from . import disk\n",
    "proxy/__init__.py": "",
    "proxy/engine/__init__.py": "",
    "proxy/engine/types.py": "from dataclasses import dataclass\n",
    "proxy/engine/tokens.py": "from proxy.engine.binding import Model\n",
    "proxy/engine/grammar.py": "from proxy.engine.binding import check_grammar\n",
    "proxy/engine/vocab.py": "import re\n",
    "proxy/engine/executor.py": "from proxy.engine import binding, types\nimport statecache.pool\n",
    "proxy/api/__init__.py": "",
    "proxy/api/app.py": ("from proxy.engine.types import GenerationRequest\n"
                         "from proxy.engine import tokens\n"
                         "from ..engine.grammar import check_grammar\n"
                         "from statecache.pages import np\n"),
    "tools/__init__.py": "",
    "tools/draft.py": "from proxy.engine.binding import Model\nimport statecache.pages\n",
    "bench/__init__.py": "",
    "bench/run.py": "from tools import draft\nfrom proxy.api import app\n",
}
BINDING = {
    "module": {"proxy/engine/binding.py": ("import llama_cpp as _ll\n"
                                           "from llama_cpp.llama_grammar import X\n"
                                           "from proxy.engine.vocab import facts\n")},
    "package": {
        "proxy/engine/binding/__init__.py": ("import llama_cpp as _ll\n"
                                             "from proxy.engine.binding.model import Model\n"
                                             "from .sampler import check_grammar\n"),
        "proxy/engine/binding/model.py": ("import llama_cpp\n"
                                          "from proxy.engine.binding.vocab import facts\n"),
        "proxy/engine/binding/sampler.py": ("def f():\n"
                                            "    from llama_cpp.llama_grammar import X\n"),
        "proxy/engine/binding/vocab.py": "import re\n",
    },
}


def write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.fixture(params=sorted(BINDING))
def tree(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A clean tree, with the binding as a module or as a package."""
    return write(tmp_path, {**CLEAN, **BINDING[request.param]})


def broken(tree: Path, rel: str, text: str) -> list[str]:
    """The violations once ``rel`` holds ``text``."""
    write(tree, {rel: text})
    return violations(tree)


def test_a_clean_tree_passes_with_either_layout(tree: Path) -> None:
    assert violations(tree) == []
    assert main([str(tree)]) == 0


@pytest.mark.parametrize(("rel", "text"), [
    ("tools/draft.py", "import llama_cpp\n"),
    ("tools/draft.py", "def f():\n    import llama_cpp as lc\n"),
    ("bench/run.py", "from llama_cpp import llama_grammar\n"),
    ("proxy/engine/executor.py", "import llama_cpp.llama_grammar\n"),
    ("proxy/engine/executor.py", "import importlib\nll = importlib.import_module('llama_cpp')\n"),
    ("statecache/pool.py", "ll = __import__('llama_cpp')\n"),
])
def test_only_the_binding_imports_llama_cpp(tree: Path, rel: str, text: str) -> None:
    found = broken(tree, rel, text)
    assert len(found) == 1 and found[0].startswith(f"{rel}:"), found
    assert "imports llama_cpp" in found[0] and "only the binding" in found[0]


@pytest.mark.parametrize(("text", "target"), [
    ("from proxy.engine.binding import check_grammar\n", "proxy.engine.binding"),
    ("from proxy.engine import binding\n", "proxy.engine.binding"),
    ("import proxy.engine.executor\n", "proxy.engine.executor"),
    ("from ..engine import executor\n", "proxy.engine.executor"),
    ("from proxy import engine\n", "proxy.engine"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
     "    from proxy.engine.vocab import facts\n", "proxy.engine.vocab"),
])
def test_the_api_imports_only_the_engines_contract(tree: Path, text: str, target: str) -> None:
    found = broken(tree, "proxy/api/app.py", text)
    assert found == [f"proxy/api/app.py:{text.count(chr(10))}: proxy.api.app imports "
                     f"{target}: proxy/api imports of the engine only proxy.engine.types, "
                     "proxy.engine.tokens, proxy.engine.grammar"]


@pytest.mark.parametrize("text", [
    "from proxy.api import app\n", "import tools.draft\n", "from bench import run\n",
    "import proxy\n",
])
def test_statecache_imports_nothing_above_it(tree: Path, text: str) -> None:
    found = broken(tree, "statecache/pool.py", text)
    assert len(found) == 1 and "statecache imports nothing of proxy, tools or bench" in found[0]


@pytest.mark.parametrize("text", [
    "from statecache import pool\n", "import statecache.pool\n",
    "def f():\n    from statecache.pool import CheckpointPool\n",
])
def test_the_tiers_import_no_pool(tree: Path, text: str) -> None:
    found = broken(tree, "statecache/tiers/ram.py", text)
    assert len(found) == 1 and found[0].startswith("statecache/tiers/ram.py:"), found
    assert "statecache.pool: the tiers (statecache/tiers) import nothing of the pool" in found[0]


@pytest.mark.parametrize(("text", "target"), [
    ("from statecache.tiers import disk\n", "statecache.tiers.disk"),
    ("from ..tiers.ram import x\n", "statecache.tiers.ram"),
    ("import statecache.pool\n", "statecache.pool"),
])
def test_the_formats_import_no_tier_and_no_pool(tree: Path, text: str, target: str) -> None:
    found = broken(tree, "statecache/formats/diskfmt.py", text)
    assert len(found) == 1 and f"statecache.formats.diskfmt imports {target}: the formats " \
        "(statecache/formats) import nothing of the tiers or the pool" in found[0], found


def test_import_circles_are_found_with_their_members(tree: Path) -> None:
    assert broken(tree, "bench/report.py", "import json\n") == []  # no circle yet
    # report -> table <- ceiling: no circle; then table imports both back, one of them
    # only from inside a function: one circle of the three
    write(tree, {"bench/report.py": "from bench import table\n",
                 "bench/table.py": "import json\n",
                 "bench/ceiling.py": "import bench.table\n"})
    assert violations(tree) == []
    found = broken(tree, "bench/table.py",
                   "import bench.ceiling\ndef f():\n    from bench.report import x\n")
    circle = "(bench.ceiling <-> bench.report <-> bench.table)"
    assert found == [
        f"bench/ceiling.py:1: bench.ceiling imports bench.table: an import circle {circle}",
        f"bench/report.py:1: bench.report imports bench.table: an import circle {circle}",
        f"bench/table.py:1: bench.table imports bench.ceiling: an import circle {circle}",
        f"bench/table.py:3: bench.table imports bench.report: an import circle {circle}"]
    # a module that imports itself is a circle of one
    write(tree, {"bench/table.py": "import json\n"})
    assert broken(tree, "tools/draft.py", "import tools.draft\n") == [
        "tools/draft.py:1: tools.draft imports tools.draft: an import circle (tools.draft)"]


@pytest.mark.parametrize("text", ["from tools import draft\n", "import bench.run\n"])
def test_proxy_imports_no_tools_or_bench(tree: Path, text: str) -> None:
    found = broken(tree, "proxy/engine/executor.py", text)
    assert len(found) == 1 and "proxy imports nothing of tools or bench" in found[0]


@pytest.mark.parametrize("text", [
    "from proxy.engine.types import SamplingParams\n",
    "from proxy.engine import executor\n",
    "from proxy.api.app import x\n",
])
def test_the_binding_imports_nothing_of_the_engine(tree: Path, text: str) -> None:
    rel = "proxy/engine/binding.py" if (tree / "proxy/engine/binding.py").is_file() \
        else "proxy/engine/binding/model.py"
    found = broken(tree, rel, text)
    assert len(found) == 1 and found[0].startswith(f"{rel}:1:"), found
    assert "the binding imports nothing of proxy but itself" in found[0]


def test_relative_imports_resolve_to_modules(tree: Path) -> None:
    found = {(i.target, i.line) for f in sources(tree) if f.name == "app.py"
             for i in imports(tree, f)}
    assert ("proxy.engine.grammar", 3) in found and ("proxy.engine.tokens", 2) in found
    assert ("proxy.engine.types", 1) in found  # a name from a module: the module


def test_main_lists_what_breaks_and_fails(tree: Path, capsys: pytest.CaptureFixture[str]
                                          ) -> None:
    write(tree, {"tools/draft.py": "import llama_cpp\n",
                 "statecache/pages.py": "from proxy.engine import types\n"})
    assert main([str(tree)]) == 1
    out = capsys.readouterr()
    assert out.out.splitlines() == [
        "statecache/pages.py:1: statecache.pages imports proxy.engine.types: statecache "
        "imports nothing of proxy, tools or bench",
        "tools/draft.py:1: tools.draft imports llama_cpp: only the binding "
        "(proxy/engine/binding) imports llama_cpp"]
    assert "2 import(s) break" in out.err
    assert main(["--help"]) == 2


def test_the_repository_keeps_the_rules(capsys: pytest.CaptureFixture[str]) -> None:
    # proxy/engine/binding.py or the package proxy/engine/binding/: the rules hold for both
    layouts = [ROOT / "proxy/engine/binding.py", ROOT / "proxy/engine/binding/__init__.py"]
    assert any(p.is_file() for p in layouts)
    assert main([str(ROOT)]) == 0, capsys.readouterr().out
    # the rule about llama_cpp has something to hold: the binding does import it
    binding = [f for f in sources(ROOT) if "binding" in f.relative_to(ROOT).parts
               or f.relative_to(ROOT).as_posix() == "proxy/engine/binding.py"]
    assert any(i.target == "llama_cpp" for f in binding for i in imports(ROOT, f))
