from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.cli import main as proxy_main
from statecache.cli import main
from statecache.records import Role
from tests.unit.conftest import PoolFactory, put

T = list(range(1, 21))


@pytest.fixture
def disk(make_pool: PoolFactory, tmp_path: Path) -> tuple[Path, list[str]]:
    """A checkpoint directory with three entries of different roles, written by a pool."""
    pool = make_pool()
    ids = [
        put(pool, T[:13], b"a" * 40, role=Role.END_OF_REPLY).id,
        put(pool, T[:8], b"b" * 40, role=Role.PERIODIC).id,
        put(pool, [7] + T[:8], b"c" * 40, role=Role.BRANCH).id,
    ]
    pool.close()
    return tmp_path / "ckpt", ids


NO_PROXY = "http://127.0.0.1:9"  # discard port: nothing listens


def test_inspect_table_and_json(
    disk: tuple[Path, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    d, ids = disk
    assert main(["inspect", "--url", NO_PROXY, "--disk-path", str(d)]) == 0
    out = capsys.readouterr().out
    assert f"proxy not reachable at {NO_PROXY}; showing disk only" in out
    assert "3 checkpoint(s)" in out and ids[0][:12] in out and "end-of-reply" in out
    assert main(["inspect", "--url", NO_PROXY, "--disk-path", str(d), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert sorted(r["id"] for r in data["checkpoints"]) == sorted(ids)
    assert all(r["tiers"] == ["disk"] for r in data["checkpoints"])
    # One entry by unique prefix.
    assert main(["inspect", ids[1][:8], "--url", NO_PROXY, "--disk-path", str(d), "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["id"] == ids[1] and one["n"] == 8 and one["role"] == "periodic"
    assert main(["inspect", "zzzz", "--url", NO_PROXY, "--disk-path", str(d)]) == 1
    assert "no checkpoint match" in capsys.readouterr().err


def test_verify_reports_bad_files(
    disk: tuple[Path, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    d, ids = disk
    key = ["--secret-path", str(d.parent / "keys" / "secret.key")]
    assert main(["verify", "--disk-path", str(d), *key]) == 0
    assert "3 ok, 0 bad" in capsys.readouterr().out
    f = d / f"{ids[2]}.ckpt"
    raw = bytearray(f.read_bytes())
    raw[-40] ^= 0xFF  # a state byte
    f.write_bytes(bytes(raw))
    assert main(["verify", "--disk-path", str(d), "--json", *key]) == 1
    report = json.loads(capsys.readouterr().out)
    assert len(report["ok"]) == 2 and report["bad"] == [
        {"file": f.name, "reason": "MAC mismatch (forged or corrupt)"}
    ]
    # Without the key nothing can be verified: said plainly, not "all bad".
    missing = ["--secret-path", str(d.parent / "nokey" / "secret.key")]
    assert main(["verify", "--disk-path", str(d), *missing]) == 1
    assert "cannot use the key file" in capsys.readouterr().err


def test_purge(disk: tuple[Path, list[str]], capsys: pytest.CaptureFixture[str]) -> None:
    d, ids = disk
    assert main(["purge", "--disk-path", str(d)]) == 2  # no filter: usage error
    # Without --yes nothing is deleted.
    assert main(["purge", "--role", "end-of-reply", "--disk-path", str(d)]) == 0
    assert "would remove 1 file(s)" in capsys.readouterr().out
    assert len(list(d.glob("*.ckpt"))) == 3
    assert main(["purge", "--role", "end-of-reply", "--disk-path", str(d), "--yes"]) == 0
    assert f"removed {ids[0]}" in capsys.readouterr().out
    assert sorted(p.stem for p in d.glob("*.ckpt")) == sorted(ids[1:])
    # The test clock dates the entries to 1970: none is older than 100,000 days...
    assert main(["purge", "--older-than", "100000d", "--disk-path", str(d), "--yes"]) == 0
    assert len(list(d.glob("*.ckpt"))) == 2
    # ...and both are older than an hour.
    assert main(["purge", "--older-than", "1h", "--disk-path", str(d), "--yes"]) == 0
    assert not list(d.glob("*.ckpt"))
    # --all also removes files that cannot be read.
    (d / ("f" * 32 + ".ckpt")).write_bytes(b"junk")
    assert main(["purge", "--all", "--disk-path", str(d), "--yes"]) == 0
    assert not list(d.glob("*.ckpt"))


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert main(["inspect", "--bogus"]) == 2
    assert main(["serve"]) == 2  # storage commands only: serve comes from proxy.cli
    assert proxy_main(["serve", "--port", "70000"]) == 2
    assert "server.port" in capsys.readouterr().err
    assert main(["purge", "--older-than", "soon", "--disk-path", "/nonexistent"]) == 2


def test_cli_import_is_light_and_module_runs() -> None:
    # No timing: check that the heavy modules stay unloaded, in a fresh interpreter.
    # statecache never imports the proxy; the proxy's command loads llama.cpp only to serve.
    for mod, heavy in (("statecache.cli", "'proxy', "), ("proxy.cli", "")):
        code = (
            f"import sys, {mod}; "
            f"print([m for m in ('numpy', 'llama_cpp', 'aiohttp', 'msgpack', {heavy}) "
            "if m in sys.modules])"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True)
        assert out.stdout.strip() == "[]", mod
    for mod in ("statecache", "proxy"):
        res = subprocess.run([sys.executable, "-m", mod, "--help"], capture_output=True,
                             text=True)
        assert res.returncode == 0 and "inspect" in res.stdout
        assert ("serve" in res.stdout) == (mod == "proxy")


def test_quarantine_is_shown_by_verify_and_inspect_and_removed_by_purge(
    disk: tuple[Path, list[str]], make_pool: PoolFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    d, ids = disk
    f = d / f"{ids[0]}.ckpt"
    f.write_bytes(f.read_bytes()[:-7])  # truncated: the next pool moves it aside
    make_pool().close()
    (q,) = (d / "quarantine").iterdir()
    key = ["--secret-path", str(d.parent / "keys" / "secret.key")]
    assert main(["verify", "--disk-path", str(d), *key]) == 0  # the live files are fine
    out = capsys.readouterr().out
    assert f"QUARANTINED  {q.name}" in out and "1 quarantined file(s)" in out
    assert main(["inspect", "--url", NO_PROXY, "--disk-path", str(d), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [x["file"] for x in report["quarantined"]] == [q.name]
    assert "purge --quarantined --yes" in report["notes"][-1]
    assert main(["purge", "--quarantined", "--disk-path", str(d), "--yes"]) == 0
    assert f"removed quarantine/{q.name}" in capsys.readouterr().out
    assert not q.exists() and len(list(d.glob("*.ckpt"))) == 2  # the live files stay


def test_purge_all_removes_leftovers_only_when_no_proxy_holds_the_directory(
    disk: tuple[Path, list[str]], make_pool: PoolFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    d, _ = disk
    pool = make_pool()  # a running proxy: its temporary files are writes in progress
    tmp = d / ".tmp-in-progress"
    tmp.write_bytes(b"x")
    assert main(["purge", "--all", "--disk-path", str(d), "--yes"]) == 0
    assert tmp.exists()
    pool.close()
    assert main(["purge", "--all", "--disk-path", str(d), "--yes"]) == 0
    assert not tmp.exists() and not list(d.glob("*.ckpt"))
    assert "removed .tmp-in-progress" in capsys.readouterr().out


def test_inspect_into_a_closed_pipe_exits_quietly(disk: tuple[Path, list[str]]) -> None:
    # `statecache inspect | head`: the reader is gone before the table is written.
    d, _ = disk
    cmd = [sys.executable, "-m", "statecache", "inspect", "--url", NO_PROXY, "--disk-path", str(d)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=Path(__file__).resolve().parents[2])
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(30) == 0
    assert err == ""


def test_a_kept_checkpoint_says_for_how_long() -> None:
    import io
    import time

    from statecache.cli.inspect import _table

    out = io.StringIO()
    now = time.time()
    _table([{"id": "a" * 32, "kind": "full", "role": "branch", "n": 64, "nbytes": 10,
             "created": now, "tiers": ["ram"], "kept_until": now + 3000},
            {"id": "b" * 32, "kind": "full", "role": "branch", "n": 32, "nbytes": 10,
             "created": now, "tiers": ["ram"], "kept_until": now - 5}], out)
    rows = out.getvalue().splitlines()
    assert "branch (kept 50m)" in rows[1], rows
    assert "(kept" not in rows[2]
