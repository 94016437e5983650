"""The import rules of the layers, checked on the source (``make check`` runs it).

    python -m tools.check_imports [ROOT]

Every import statement of the packages statecache, proxy, tools and bench (inside
functions and under ``TYPE_CHECKING`` too, and ``importlib.import_module("...")`` /
``__import__("...")`` with a literal name) must keep these rules:

- only the binding (proxy/engine/binding.py, or the package proxy/engine/binding/)
  imports ``llama_cpp``;
- proxy/api imports of the engine only its contract: ``proxy.engine.types`` (requests,
  events, sampling), ``proxy.engine.tokens`` (the tokenizer's face) and
  ``proxy.engine.grammar`` (checking grammars and schemas);
- statecache imports nothing of proxy, tools or bench;
- proxy imports nothing of tools or bench;
- the binding imports nothing of proxy but itself and ``proxy.engine.vocab``.

Exit status 1 with one line per import that breaks a rule, else 0. Tests are not
checked (tests/model reads llama.cpp directly to establish facts about it).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("statecache", "proxy", "tools", "bench")
API_MAY_IMPORT = ("proxy.engine.types", "proxy.engine.tokens", "proxy.engine.grammar")
BINDING_MAY_IMPORT = ("proxy.engine.binding", "proxy.engine.vocab")


@dataclass(frozen=True, slots=True)
class Import:
    path: str  # the importing file, relative to the root ("proxy/api/app.py")
    module: str  # its dotted name ("proxy.api.app")
    target: str  # the module imported ("proxy.engine.types"; a name's module for "from")
    line: int


def _within(name: str, *modules: str) -> bool:
    """Whether ``name`` is one of ``modules`` or inside one."""
    return any(name == m or name.startswith(m + ".") for m in modules)


def _is_binding(path: str) -> bool:
    return path == "proxy/engine/binding.py" or path.startswith("proxy/engine/binding/")


def only_the_binding_imports_llama_cpp(imp: Import) -> str | None:
    if _within(imp.target, "llama_cpp") and not _is_binding(imp.path):
        return "only the binding (proxy/engine/binding) imports llama_cpp"
    return None


def the_api_imports_only_the_engines_contract(imp: Import) -> str | None:
    if (_within(imp.module, "proxy.api") and _within(imp.target, "proxy.engine")
            and not _within(imp.target, *API_MAY_IMPORT)):
        return "proxy/api imports of the engine only " + ", ".join(API_MAY_IMPORT)
    return None


def storage_stands_alone(imp: Import) -> str | None:
    if _within(imp.module, "statecache") and _within(imp.target, "proxy", "tools", "bench"):
        return "statecache imports nothing of proxy, tools or bench"
    return None


def the_runtime_needs_no_tools(imp: Import) -> str | None:
    if _within(imp.module, "proxy") and _within(imp.target, "tools", "bench"):
        return "proxy imports nothing of tools or bench"
    return None


def the_binding_stands_alone(imp: Import) -> str | None:
    if (_is_binding(imp.path) and _within(imp.target, "proxy")
            and not _within(imp.target, *BINDING_MAY_IMPORT)):
        return "the binding imports nothing of proxy but itself and proxy.engine.vocab"
    return None


RULES: tuple[Callable[[Import], str | None], ...] = (
    only_the_binding_imports_llama_cpp,
    the_api_imports_only_the_engines_contract,
    storage_stands_alone,
    the_runtime_needs_no_tools,
    the_binding_stands_alone,
)


def module_name(rel: Path) -> str:
    """proxy/api/app.py -> proxy.api.app; proxy/engine/binding/__init__.py ->
    proxy.engine.binding."""
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(root: Path, name: str) -> bool:
    base = root.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _from_base(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module an ``import from`` names, relative imports resolved."""
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    keep = len(parts) - node.level + (1 if is_package else 0)
    base = ".".join(parts[:max(keep, 0)])
    return f"{base}.{node.module}" if node.module and base else (node.module or base)


def _dynamic(node: ast.Call) -> str | None:
    """The literal module name of ``importlib.import_module("x")`` or ``__import__("x")``."""
    fn = node.func
    name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
    if name in ("import_module", "__import__") and node.args:
        arg = node.args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value
    return None


def imports(root: Path, file: Path) -> Iterator[Import]:
    """Every import of one file, each alias of an ``import from`` resolved to the
    submodule it names when it is one."""
    rel = file.relative_to(root)
    module, is_package = module_name(rel), rel.name == "__init__.py"
    path = rel.as_posix()
    tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(path, module, alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(node, module, is_package)
            for alias in node.names:
                sub = f"{base}.{alias.name}" if base else alias.name
                target = sub if alias.name != "*" and _is_module(root, sub) else base
                yield Import(path, module, target, node.lineno)
        elif isinstance(node, ast.Call):
            named = _dynamic(node)
            if named is not None:
                yield Import(path, module, named, node.lineno)


def sources(root: Path) -> Iterator[Path]:
    for package in PACKAGES:
        folder = root / package
        if folder.is_dir():
            yield from sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def violations(root: Path) -> list[str]:
    """One line per import that breaks a rule: "path:line: module imports target: rule"."""
    out: list[str] = []
    for file in sources(root):
        for imp in imports(root, file):
            for rule in RULES:
                why = rule(imp)
                if why is not None:
                    out.append(f"{imp.path}:{imp.line}: {imp.module} imports {imp.target}: "
                               f"{why}")
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1 or (args and args[0].startswith("-")):
        print("usage: python -m tools.check_imports [ROOT]", file=sys.stderr)
        return 2
    root = Path(args[0]).resolve() if args else ROOT
    found = violations(root)
    for line in found:
        print(line)
    if found:
        print(f"{len(found)} import(s) break the layering rules (tools/check_imports.py)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
