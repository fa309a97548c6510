"""`kvstore trace start|stop` against a real daemon subprocess, then `kvstore advise` on its file.
The CLI runs in this process (kvstore.cli.main), to spare a Python start per command."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from bench.servers import running_daemon
from kvstore.block import encode_block
from kvstore.cli import main
from kvstore.ops.trace import MISS, key_hash, read_trace
from kvstore.server.auth import AuthError, ClientAuth
from kvstore.store.observers import OP_GET, OP_LOOKUP, OP_PUT
from tests.fixtures_kvstore import connect, fetch


@pytest.fixture
def kvstore(capsys: pytest.CaptureFixture[str]):  # type: ignore[no-untyped-def]
    """Run one `kvstore ...` command: (exit code, stdout, stderr)."""

    def run(*args: str) -> tuple[int, str, str]:
        code = main(list(args))
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_daemon(tmp_path_factory.mktemp("daemon"), "--cpu", "64KiB") as address:
        yield address


def blk(key: bytes) -> bytes:
    return encode_block(key, np.zeros(4000, dtype=np.uint8))


def test_trace_start_stop_records_the_daemons_accesses(daemon: str, tmp_path: Path, kvstore,  # type: ignore[no-untyped-def]
                                                       monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)
    code, out, err = kvstore("trace", "start", "--address", daemon, "--out", "t.kvtrace", "--max-records", "1000")
    assert code == 0, err
    path = Path(out.split("tracing to ", 1)[1].split(" (", 1)[0])
    assert path.name == "t.kvtrace" and path.parent.name == "traces"  # a name: in the daemon's traces dir
    assert not (tmp_path / "t.kvtrace").exists()
    code, _, err = kvstore("trace", "start", "--address", daemon, "--out", str(tmp_path / "u.kvtrace"))
    assert code == 2 and "already running" in err and err.count("\n") == 1
    keys = [b"trace-%d" % i for i in range(30)]
    with connect(daemon, use_shm=False) as c:
        c.lookup(keys[:2])
        c.put_many([(k, blk(k)) for k in keys])  # 30 x 4 KB over a 64 KiB cpu tier: the first ones are dropped
        found = fetch(c, [keys[-1], keys[0]])
    assert found[0] is not None and found[1] is None
    code, out, err = kvstore("trace", "stop", "--address", daemon)
    assert code == 0 and "wrote 34 records" in out, err
    trace = read_trace(path)
    r = trace.records
    assert trace.tiers[0].name == "cpu" and trace.tiers[0].capacity_bytes == 64 * 1024
    assert r["op"].tolist() == [OP_LOOKUP] * 2 + [OP_PUT] * 30 + [OP_GET] * 2
    assert r["key"].tolist()[2:32] == [int.from_bytes(key_hash(k), "little") for k in keys]
    assert r["tier"].tolist()[-2:] == [0, MISS] and set(r["tier"][2:32].tolist()) == {MISS}
    assert set(r["size"][2:33].tolist()) == {len(blk(keys[0]))}

    code, out, err = kvstore("advise", str(path), "--json", "--png", str(tmp_path / "c.png"))
    assert code == 0, err
    advice = json.loads(out)
    assert advice["demands"] == 32 and advice["tiers"][0]["name"] == "cpu"  # 30 fresh puts, a hit, a miss
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_trace_calls_need_the_token(daemon: str, tmp_path: Path, kvstore) -> None:  # type: ignore[no-untyped-def]
    with connect(daemon, use_shm=False, auth=ClientAuth(token="wrong-token-0123456789")) as c:
        with pytest.raises(AuthError):
            c.trace_start(str(tmp_path / "x.kvtrace"))
    assert not (tmp_path / "x.kvtrace").exists()
    code, _, err = kvstore("trace", "stop", "--address", daemon)
    assert code == 2 and "no trace is running" in err


def test_trace_files_go_only_in_the_daemons_traces_dir(daemon: str, tmp_path: Path, kvstore) -> None:  # type: ignore[no-untyped-def]
    code, _, err = kvstore("trace", "start", "--address", daemon, "--out", str(tmp_path / "x.kvtrace"))
    assert code == 2 and "is not in the daemon's traces directory" in err
    assert err.count("\n") == 1 and not (tmp_path / "x.kvtrace").exists()
    code, _, err = kvstore("trace", "stop", "--address", daemon)
    assert code == 2 and "no trace is running" in err

