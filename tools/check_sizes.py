"""Module and class sizes in statecache and proxy, checked on the source (``make check``
runs it): no module over ``MODULE_LINES`` lines and no class over ``CLASS_LINES``, so a
room that grows past one concept is split before it becomes the next god class.

    python -m tools.check_sizes [ROOT]

Exit status 1 with one line per module or class over its bound, else 0; the largest of
each are printed either way.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("statecache", "proxy")
MODULE_LINES = 400
CLASS_LINES = 300


def sizes(root: Path) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(lines, path) of every module and (lines, path:Class) of every class, largest first."""
    modules: list[tuple[int, str]] = []
    classes: list[tuple[int, str]] = []
    for package in PACKAGES:
        for file in sorted((root / package).rglob("*.py")):
            rel = file.relative_to(root).as_posix()
            text = file.read_text(encoding="utf-8")
            modules.append((len(text.splitlines()), rel))
            for node in ast.walk(ast.parse(text, filename=rel)):
                if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                    classes.append((node.end_lineno - node.lineno + 1, f"{rel}:{node.name}"))
    return sorted(modules, reverse=True), sorted(classes, reverse=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1 or (args and args[0].startswith("-")):
        print("usage: python -m tools.check_sizes [ROOT]", file=sys.stderr)
        return 2
    modules, classes = sizes(Path(args[0]).resolve() if args else ROOT)
    over = [f"{path}: {n} lines, more than {MODULE_LINES} in a module"
            for n, path in modules if n > MODULE_LINES]
    over += [f"{path}: {n} lines, more than {CLASS_LINES} in a class"
             for n, path in classes if n > CLASS_LINES]
    for line in over:
        print(line)
    if modules and classes:
        print(f"largest module {modules[0][1]} ({modules[0][0]} lines), largest class "
              f"{classes[0][1]} ({classes[0][0]} lines)", file=sys.stderr)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
