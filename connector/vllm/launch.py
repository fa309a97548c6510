"""Start and stop a vLLM OpenAI server with (or without) TierKVConnector: demo, bench and tests.

vLLM runs in its own venv (vLLM's CPU build pins torch, transformers and fastapi differently
from kvengine; ``make vllm-setup`` builds ``.venv-vllm`` with tierkv installed into it), so it is
always a subprocess of that venv's python: ``vllm_python()`` finds it (``TIERKV_VLLM_PYTHON``, else
``.venv-vllm/bin/python`` beside this checkout). Offline and loopback-only, with the settings
vLLM needs here: ``HF_HUB_OFFLINE``, no usage stats, ``VLLM_HOST_IP=127.0.0.1`` (else it opens a
socket to a public address to learn its own IP).

    with VLLMServer(model_dir, kvstore="127.0.0.1:50551", blocks=24, log=path) as srv:
        srv.url  # http://127.0.0.1:PORT/v1
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SERVED_NAME = "smollm2"
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
               "VLLM_HOST_IP": "127.0.0.1", "VLLM_LOGGING_LEVEL": "INFO"}  # fmt: skip


class VLLMUnavailable(RuntimeError):
    """No python with vLLM installed was found (``make vllm-setup`` builds one)."""


def vllm_python() -> str:
    env = os.environ.get("TIERKV_VLLM_PYTHON")
    candidates = [env] if env else [str(ROOT / ".venv-vllm" / "bin" / "python")]
    for c in candidates:
        if c and Path(c).exists():
            return c
    raise VLLMUnavailable(f"no vLLM python at {candidates[0]}: run `make vllm-setup` (or set TIERKV_VLLM_PYTHON)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def transfer_config(kvstore: str, token_file: str = "", **extra: Any) -> dict[str, Any]:
    """The ``--kv-transfer-config`` that loads TierKVConnector (README: "Using tierkv from vLLM")."""
    cfg: dict[str, Any] = {"kvstore": kvstore, **extra}
    if token_file:
        cfg["token_file"] = token_file
    return {"kv_connector": "TierKVConnector", "kv_connector_module_path": "connector.vllm", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": cfg}  # fmt: skip


class VLLMServer:
    """``cores``: the CPU cores vLLM's compute threads run on ("all", or vLLM's syntax: "0", "0-1")."""

    def __init__(self, model_dir: str | Path, kvstore: str | None = None, *, token_file: str = "",
                 blocks: int | None = None, max_model_len: int = 2048, port: int | None = None,
                 log: Path | None = None, extra: dict[str, Any] | None = None, kv_space_gib: int = 1,
                 args: tuple[str, ...] = (), env: dict[str, str] | None = None, cores: str = "all") -> None:  # fmt: skip
        self.model_dir, self.kvstore, self.port = str(model_dir), kvstore, port or free_port()
        self.log = log
        argv = [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
                "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(self.port),
                "--max-model-len", str(max_model_len), "--enforce-eager", "--dtype", "bfloat16",
                "--seed", "0", "--uvicorn-log-level", "warning", *args]  # fmt: skip
        if blocks is not None:
            argv += ["--num-gpu-blocks-override", str(blocks)]
        if kvstore is not None:
            argv += ["--kv-transfer-config", json.dumps(transfer_config(kvstore, token_file, **(extra or {})))]
        self.argv = argv
        self.env = dict(os.environ, **OFFLINE_ENV, VLLM_CPU_KVCACHE_SPACE=str(kv_space_gib), **(env or {}))
        # vLLM's CPU backend picks its OpenMP cores itself, and reserves one more when a KV connector
        # is configured: the same server with and without the connector would then compute with
        # different thread counts (different float sums: not comparable, token for token). Name them.
        self.env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{os.cpu_count() - 1}" if cores == "all" else cores
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, wait: bool = True, timeout_s: float = 300.0) -> VLLMServer:
        out = open(self.log, "ab") if self.log is not None else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)  # fmt: skip
        finally:
            if self.log is not None:
                out.close()  # type: ignore[union-attr]
        if wait:
            self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode} before serving:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vLLM did not serve within {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log is not None and self.log.exists() else ""

    def metrics(self) -> dict[str, float]:
        """This server's /metrics: ``name{labels}`` -> value (our counters and vLLM's)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                try:
                    out[name] = float(value)
                except ValueError:
                    continue
        return out

    def tierkv(self, metric: str, **labels: str) -> float:
        """The sum of the counter ``tierkv_connector_vllm_<metric>_total`` over the series matching ``labels``."""
        total = 0.0
        head = f"tierkv_connector_vllm_{metric}_total"
        for name, v in self.metrics().items():
            if name.partition("{")[0] == head and all(f'{k}="{x}"' in name for k, x in labels.items()):
                total += v
        return total

    def stop(self, grace_s: float = 20.0) -> None:
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
        except ProcessLookupError:
            pass

    def __enter__(self) -> VLLMServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
