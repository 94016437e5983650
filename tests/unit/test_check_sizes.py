"""tools/check_sizes.py: a module or class past its bound is named; the repository keeps
the bounds."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.check_sizes import CLASS_LINES, MODULE_LINES, ROOT, main


def test_a_long_module_and_a_long_class_are_named(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "statecache").mkdir()
    (tmp_path / "proxy").mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(CLASS_LINES))  # the class line too
    (tmp_path / "statecache" / "pool.py").write_text("class Pool:\n" + body)
    (tmp_path / "proxy" / "big.py").write_text("x = 1\n" * (MODULE_LINES + 1))
    (tmp_path / "proxy" / "fine.py").write_text("class Fine:\n" + body[:-len("    x299 = 299\n")])
    assert main([str(tmp_path)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"proxy/big.py: {MODULE_LINES + 1} lines, more than {MODULE_LINES} in a module",
        f"statecache/pool.py:Pool: {CLASS_LINES + 1} lines, more than {CLASS_LINES} in a class"]


def test_the_repository_keeps_the_bounds(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(ROOT)]) == 0, capsys.readouterr().out
