"""bench/gpu_check.sh in its CPU dry run: every step runs (small sizes, a tiny model, nothing
installed) and the JSON it promises lands under $OUT. It has not run on a GPU here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run(tmp_path: Path, tiny_model_dir: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PY": sys.executable, "WHEELS": str(tmp_path / "none"),
           "TIERKV_GPU_CHECK_MODEL": str(tiny_model_dir), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    out = tmp_path / "out"
    assert proc.returncode == 0, proc.stderr + "".join(p.read_text()[-2000:] for p in out.glob("*.log"))
    summary = json.loads((out / "gpu_check.json").read_text())
    steps = {s["step"]: s for s in summary["steps"]}
    assert list(steps) == ["install", "build", "gpu_tests", "native_tests", "gpu_load"]
    assert summary["ok"] and summary["mode"] == "--dry-run"
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        assert "would-install:flashinfer-python" in steps["install"]["note"]
    load = json.loads((out / "gpu_load.json").read_text())
    assert load["device"] == "cpu"
    assert load["load"]["pages_loaded"] == 4 and load["load"]["last_page_identical"]
    assert load["load"]["connector_gbps"] > 0 and load["load"]["pinned_copy_gbps"] > 0
    assert load["ttft"]["fidelity_identical"] and load["ttft"]["kv_bytes_loaded"] > 0


def test_gpu_check_rejects_unknown_mode(tmp_path: Path) -> None:
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--bogus"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "usage" in proc.stderr
