"""The fuzzer: malformed inputs to the block decoder, every gRPC handler of a real daemon, its raw
stream channel and the engine's HTTP API; each case must end in a clear answer within its deadline.

    python -m bench.soak.fuzz --fuzz-cases 10000 [--seed 1] [--out F.json] [--http URL] [--only daemon|http]

starts a ``kvstore serve`` (cpu + disk, auth on) on a free loopback port and fuzzes it (with
``--http``, 15 % of the cases go to that ``kvengine serve`` instead); the soak (bench/soak/run.py)
runs both sides beside its own cluster, the HTTP side against one of its replicas. A *crash* is a case that ends
any other way: an exception the decoder should not raise, a gRPC status that is not a clear
refusal (UNKNOWN from an uncaught exception, INTERNAL, UNAVAILABLE, DEADLINE_EXCEEDED for a hang,
or any refusal without a message), a stream-channel reply that is not well-framed, an HTTP 5xx,
or a daemon that no longer serves its canary blocks byte for byte afterwards. Cases come from
hypothesis strategies (bench/soak/fuzz_cases.py) under a fixed seed: a run is reproducible.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hseed
from hypothesis import strategies as st

from kvstore.block import block_fault, decode_block, read_header, verify_payload
from kvstore.errors import BlockFormatError

T = TypeVar("T")
MAX_CRASHES_KEPT = 50


@dataclass
class Tally:
    """What a fuzz run saw: cases and outcomes per target, and the crashes (the first few in full)."""

    cases: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)  # "target code" -> count
    crashes: int = 0
    crash_cases: list[dict[str, str]] = field(default_factory=list)
    unauthenticated_accepted: int = 0

    def record(self, target: str, outcome: str, crash: str | None = None, case: object = None) -> None:
        self.cases[target] += 1
        self.outcomes[f"{target} {outcome}"] += 1
        if crash is not None:
            self.crashes += 1
            if len(self.crash_cases) < MAX_CRASHES_KEPT:
                self.crash_cases.append({"target": target, "outcome": outcome, "why": crash,
                                         "case": repr(case)[:600]})  # fmt: skip

    def merge(self, other: Tally) -> None:
        self.cases.update(other.cases)
        self.outcomes.update(other.outcomes)
        self.crashes += other.crashes
        self.crash_cases += other.crash_cases[: MAX_CRASHES_KEPT - len(self.crash_cases)]
        self.unauthenticated_accepted += other.unauthenticated_accepted

    @property
    def total(self) -> int:
        return sum(self.cases.values())

    def as_json(self) -> dict[str, Any]:
        return {"cases": self.total, "crashes": self.crashes, "by_target": dict(sorted(self.cases.items())),
                "outcomes": dict(sorted(self.outcomes.items())), "crash_cases": self.crash_cases,
                "unauthenticated_accepted": self.unauthenticated_accepted}


def run_cases(strategy: st.SearchStrategy[T], n: int, seed: int, body: Callable[[T], None],
              tally: Tally | None = None, target: str = "") -> int:  # fmt: skip
    """Call ``body`` on ``n`` cases drawn from ``strategy`` (seeded: the same cases every run).

    ``body`` records outcomes; an exception out of it (a fault of the fuzzer itself) is recorded
    in ``tally`` as a crash of ``target`` rather than ending the run, so hypothesis only generates
    (no shrinking); a strategy with fewer than ``n`` distinct cases is drawn again under the next seed."""
    done = 0
    for attempt in range(50):
        if done >= n:
            break
        before = done

        @settings(max_examples=n - done, database=None, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck), derandomize=False)  # fmt: skip
        @hseed(seed * 1000 + attempt)
        @given(strategy)
        def go(case: T) -> None:
            nonlocal done
            if done < n:
                done += 1
                try:
                    body(case)
                except Exception as e:  # noqa: BLE001
                    if tally is None:
                        raise
                    tally.record(target, "fuzzer-error", f"{type(e).__name__}: {e}", case)

        go()
        if done == before:
            break
    return done


# -- the block decoder (in-process) ----------------------------------------------------------
def check_block(buf: bytes) -> str | None:
    """Why decoding ``buf`` misbehaved, or None: only BlockFormatError (or ChecksumError) may be
    raised, and a block that decodes must be self-consistent."""
    try:
        hdr = read_header(buf)
        verify_payload(hdr, [memoryview(buf)[hdr.size :]])
    except BlockFormatError:
        pass
    except Exception as e:  # noqa: BLE001 - exactly what the fuzzer looks for
        return f"read_header/verify_payload raised {type(e).__name__}: {e}"
    for verify in (True, False):
        try:
            blk = decode_block(buf, verify=verify)
        except BlockFormatError:
            continue
        except Exception as e:  # noqa: BLE001
            return f"decode_block(verify={verify}) raised {type(e).__name__}: {e}"
        try:
            arr = blk.array()
        except Exception as e:  # noqa: BLE001
            return f"a decoded block's array() raised {type(e).__name__}: {e}"
        if arr.nbytes != blk.nbytes or tuple(arr.shape) != blk.shape:
            return f"decoded block inconsistent: array {arr.shape} {arr.nbytes} B, payload {blk.nbytes} B"
    try:
        block_fault(buf, b"k")
    except Exception as e:  # noqa: BLE001
        return f"block_fault raised {type(e).__name__}: {e}"
    return None


def fuzz_blocks(n: int, seed: int) -> Tally:
    from bench.soak.fuzz_cases import bad_blocks

    tally = Tally()

    def one(buf: bytes) -> None:
        why = check_block(buf)
        tally.record("block", "crash" if why else "ok", why, buf[:120])

    run_cases(bad_blocks(), n, seed, one)
    return tally


# -- the whole run -----------------------------------------------------------------------------
HTTP_SHARE = 0.15  # of all cases, when the HTTP API is fuzzed too
API_KEY_ENV = "TIERKV_FUZZ_API_KEY"  # the API key sent with each HTTP case (a server with --api-keys)


def split_cases(total: int) -> dict[str, int]:
    """How ``total`` daemon-side cases divide between the targets (every gRPC handler gets its share)."""
    from bench.soak.fuzz_grpc import HANDLERS

    weights = {"block": 3, "stream": 2, **dict.fromkeys(HANDLERS, 1)}
    unit = total / sum(weights.values())
    shares = {k: max(1, int(unit * w)) for k, w in weights.items()}
    shares["block"] += max(0, total - sum(shares.values()))
    return shares


def fuzz_daemon_side(address: str, token: str, total: int, seed: int, work: Path, deadline_s: float = 10.0,
                     log_path: Path | None = None) -> Tally:  # fmt: skip
    """``total`` cases over the block decoder, every gRPC handler and the stream channel of ``address``."""
    from bench.soak.fuzz_grpc import GrpcFuzzer

    shares = split_cases(total)
    tally = fuzz_blocks(shares.pop("block"), seed)
    with GrpcFuzzer(address, token, work, deadline_s, log_path) as g:
        tally.merge(g.run(shares, seed))
    return tally


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.soak.fuzz", description=__doc__.split("\n")[0])
    ap.add_argument("--fuzz-cases", type=int, default=10_000, help="cases in all (default %(default)s)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--address", default="", help="fuzz this daemon (default: start one)")
    ap.add_argument("--token", default="", help="its bearer token (with --address)")
    ap.add_argument("--http", default="", help=f"also fuzz this `kvengine serve` base URL ({round(HTTP_SHARE * 100)}%% of the cases)")
    ap.add_argument("--only", choices=["daemon", "http"], default=None, help="fuzz one side only")
    ap.add_argument("--out", default="", help="write the tally as JSON here")
    a = ap.parse_args(argv)
    if a.only == "http" and not a.http:
        ap.error("--only http needs --http URL")
    http_cases = {"http": a.fuzz_cases, "daemon": 0}.get(a.only or "", int(a.fuzz_cases * HTTP_SHARE) if a.http else 0)
    t0 = time.monotonic()
    tally = Tally()
    with tempfile.TemporaryDirectory(prefix="tierkv-fuzz-") as tmp:
        work, daemon_cases = Path(tmp), a.fuzz_cases - http_cases
        if daemon_cases and a.address:
            tally.merge(fuzz_daemon_side(a.address, a.token, daemon_cases, a.seed, work))
        elif daemon_cases:
            from bench.soak.fuzz_grpc import fuzz_daemon

            with fuzz_daemon(work) as (address, token, log):
                tally.merge(fuzz_daemon_side(address, token, daemon_cases, a.seed, work, log_path=log))
    if http_cases:
        from bench.soak.fuzz_http import fuzz_http

        tally.merge(fuzz_http(a.http, http_cases, a.seed, api_key=os.environ.get(API_KEY_ENV, "")))
    doc = {**tally.as_json(), "seed": a.seed, "wall_s": round(time.monotonic() - t0, 1)}
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=2))
    print(json.dumps({k: doc[k] for k in ("cases", "crashes", "unauthenticated_accepted", "wall_s")}))
    for c in tally.crash_cases[:10]:
        print("CRASH", c, file=sys.stderr)
    return 1 if tally.crashes or tally.unauthenticated_accepted else 0


if __name__ == "__main__":
    sys.exit(main())
