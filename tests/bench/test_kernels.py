"""bench.kernels runs end to end on a small pass and writes the figures the issue asks for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import kernels
from connector import native


def test_run_reports_every_op_against_memcpy() -> None:
    if native.status().impl != "native":
        pytest.skip(native.status().reason)
    res = kernels.run(pages=3, reps=1)
    assert set(res["ops"]) == {"unpack_verify", "pack_checksum", "unpack_verify_batch", "pack_checksum_batch",
                               "rope_rerotate"}
    for op in res["ops"].values():
        assert op["native_gbps"] > 0 and op["fallback_gbps"] > 0
    uv = res["ops"]["unpack_verify"]
    assert uv["per_block_copy_gbps"] > 0 and uv["native_over_per_block_copy"] == uv["native_gbps"] / uv["per_block_copy_gbps"]
    assert res["memcpy_gbps"] > 0 and res["pass_bytes"] == 3 * kernels.LAYERS * 2 * kernels.SEG


def test_main_refuses_without_the_native_ops(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(native, "status", lambda: native.NativeStatus("fallback", "not built"))
    assert kernels.main(["--quick", "--out", str(tmp_path / "k.json")]) == 2
    assert not (tmp_path / "k.json").exists()


def test_main_writes_json(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if native.status().impl != "native":
        pytest.skip(native.status().reason)
    monkeypatch.setattr(kernels, "run", lambda pages, reps: {"pages": pages, "reps": reps})  # main's wiring only
    assert kernels.main(["--quick", "--out", str(tmp_path / "k.json")]) == 0
    data = json.loads((tmp_path / "k.json").read_text())
    assert (data["pages"], data["reps"], data["meta"]["implementation"]) == (128, 5, "native")
