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
- inside statecache, the tiers (statecache/tiers/) import nothing of the pool
  (statecache/pool/), and the formats (statecache/formats/) nothing of the tiers or
  the pool: formats -> tiers -> pool, never back;
- proxy imports nothing of tools or bench;
- the binding imports nothing of proxy but itself and ``proxy.engine.vocab``;
- no import circle anywhere: no module reaches itself through the imports of these
  packages (each import of a circle is listed, with the circle). Circles are looked
  for among the imports that keep the rules above: one that breaks a rule is listed
  for that, and mending it mends any circle it closes.

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


def the_tiers_import_no_pool(imp: Import) -> str | None:
    if _within(imp.module, "statecache.tiers") and _within(imp.target, "statecache.pool"):
        return "the tiers (statecache/tiers) import nothing of the pool"
    return None


def the_formats_import_no_tiers(imp: Import) -> str | None:
    if (_within(imp.module, "statecache.formats")
            and _within(imp.target, "statecache.tiers", "statecache.pool")):
        return "the formats (statecache/formats) import nothing of the tiers or the pool"
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
    the_tiers_import_no_pool,
    the_formats_import_no_tiers,
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


def circles(found: list[Import]) -> list[tuple[Import, tuple[str, ...]]]:
    """Each import whose module and target import each other, through any number of
    modules of the packages, with the modules of that circle (sorted): the strongly
    connected components of the import graph (Tarjan's algorithm), a module that
    imports itself included."""
    modules = {imp.module for imp in found}
    graph: dict[str, set[str]] = {}
    for imp in found:
        if imp.target in modules:
            graph.setdefault(imp.module, set()).add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    part: dict[str, tuple[str, ...]] = {}

    def visit(v: str) -> None:  # iterative: the graph is deep enough for recursion limits
        work = [(v, iter(sorted(graph.get(v, ()))))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        while work:
            node, edges = work[-1]
            for w in edges:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    members: list[str] = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        members.append(w)
                        if w == node:
                            break
                    for m in members:
                        part[m] = tuple(sorted(members))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [(imp, part[imp.module]) for imp in found
            if imp.module in part and part[imp.module] == part.get(imp.target)
            and (len(part[imp.module]) > 1 or imp.module == imp.target)]


def violations(root: Path) -> list[str]:
    """One line per import that breaks a rule: "path:line: module imports target: rule"."""
    out: list[str] = []
    kept: list[Import] = []  # the imports that keep every rule: where circles are looked for
    for file in sources(root):
        for imp in imports(root, file):
            broken = [why for rule in RULES if (why := rule(imp)) is not None]
            out += [f"{imp.path}:{imp.line}: {imp.module} imports {imp.target}: {why}"
                    for why in broken]
            if not broken:
                kept.append(imp)
    for imp, members in circles(kept):
        out.append(f"{imp.path}:{imp.line}: {imp.module} imports {imp.target}: an import "
                   f"circle ({' <-> '.join(members)})")
    return list(dict.fromkeys(out))  # "from x import a, b": one line, not two


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
