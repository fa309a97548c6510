"""``kvstore serve [flags]`` runs the daemon (``--check-config``: validate and exit);
``kvstore stats --address ADDR`` prints a table; ``kvstore health --address ADDR`` exits 0 when the
daemon answers SERVING on gRPC health (container health checks); ``kvstore trace start|stop`` records
the daemon's accesses to a file and ``kvstore advise TRACE`` sizes each tier from it (kvstore/advise.py)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from kvstore import auth
from kvstore.auth import ClientAuth
from kvstore.config import StoreConfig, build_arg_parser, load_config
from kvstore.errors import KVStoreError
from tiers.errors import TierKVError


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _client_auth(args: argparse.Namespace) -> ClientAuth:
    """Health sends no token (the daemon exempts it: it works before the token file exists)."""
    return ClientAuth.from_env(token_file=getattr(args, "token_file", None) or "", tls_ca=args.tls_ca or "",
                               tls_cert=args.tls_cert or "", tls_key=args.tls_key or "",
                               with_token=args.cmd != "health")  # fmt: skip


def print_stats(address: str, deadline_s: float, auth: ClientAuth | None = None) -> int:
    from kvstore.client import KVStoreClient

    with KVStoreClient(address, deadline_s=deadline_s, use_shm=False, auth=auth) as c:
        st = c.stats()
    cols = ("tier", "used", "capacity", "blocks", "hits", "misses", "evict", "spills", "promo", "dropped", "errors", "up")
    rows = [
        (t.name, _fmt_bytes(t.used_bytes), _fmt_bytes(t.capacity_bytes), t.blocks, t.hits, t.misses, t.evictions,
         t.spills, t.promotions, t.dropped, t.errors, "yes" if t.available else "NO")
        for t in st.tiers
    ]  # fmt: skip
    widths = [max(len(str(x)) for x in col) for col in zip(cols, *rows, strict=True)]
    for row in (cols, *rows):
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths, strict=True)))
    print(f"spill queue: {st.pending_blocks} blocks, {_fmt_bytes(st.pending_bytes)}")
    for t in st.tiers:
        if t.last_error:
            print(f"{t.name} last error: {t.last_error}")
    return 0


def check_health(address: str, deadline_s: float, auth: ClientAuth | None = None) -> int:
    from kvstore.client import KVStoreClient

    with KVStoreClient(address, deadline_s=deadline_s, use_shm=False, auth=auth) as c:
        ok = c.health()
    print("SERVING" if ok else "NOT SERVING")
    return 0 if ok else 1


def trace_command(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvstore.client import KVStoreClient

    with KVStoreClient(args.address, deadline_s=args.deadline, use_shm=False, auth=_client_auth(args)) as c:
        if args.action == "start":  # a relative --out is relative to where the command runs
            path = c.trace_start(str(Path(args.out).absolute()) if args.out else "", args.max_records)
            print(f"tracing to {path} (written at `kvstore trace stop`)")
        else:
            path, records, overwritten = c.trace_stop()
            print(f"wrote {records} records to {path}" + (f" ({overwritten} older ones overwritten)" if overwritten else ""))
    return 0


def describe(cfg: StoreConfig) -> str:
    """One line per tier (secrets masked by TierConfig's repr) for --check-config."""
    lines = [f"listen {cfg.listen}" + (f", metrics {cfg.metrics_listen}" if cfg.metrics_listen else "")]
    lines += [f"  {t!r}" for t in cfg.tiers]
    lines += auth.describe(cfg)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstore", description="tierkv KV-cache daemon")
    sub = parser.add_subparsers(dest="cmd", required=True)
    serve_p = sub.add_parser("serve", help="run the daemon", add_help=False)
    build_arg_parser(serve_p)
    serve_p.add_argument("-h", "--help", action="help")
    serve_p.add_argument("--log-level", default="INFO")
    stats_p = sub.add_parser("stats", help="print the daemon's per-tier statistics")
    stats_p.add_argument("--address", default="127.0.0.1:50551")
    stats_p.add_argument("--deadline", type=float, default=5.0)
    health_p = sub.add_parser("health", help="exit 0 if the daemon is serving (gRPC health check)")
    health_p.add_argument("--address", default="127.0.0.1:50551")
    health_p.add_argument("--deadline", type=float, default=3.0)
    stats_p.add_argument("--token-file", help="bearer token file (default: TIERKV_TOKEN, TIERKV_TOKEN_FILE, "
                         "then the daemon's default token file on this machine)")
    trace_p = sub.add_parser("trace", help="start or stop recording the daemon's accesses (for `kvstore advise`)")
    trace_p.add_argument("action", choices=("start", "stop"))
    trace_p.add_argument("--out", help="trace file on the daemon's host (start; default: a new file in its cache dir)")
    trace_p.add_argument("--max-records", type=int, default=0,
                         help="ring size: older records are overwritten (start; default 1000000, 24 bytes each)")
    trace_p.add_argument("--address", default="127.0.0.1:50551")
    trace_p.add_argument("--deadline", type=float, default=30.0)
    trace_p.add_argument("--token-file", help="bearer token file (as for stats)")
    advise_p = sub.add_parser("advise", help="miss-ratio curves and tier sizes from a trace")
    from kvstore.advise_report import add_arguments

    add_arguments(advise_p)
    for p in (stats_p, health_p, trace_p):
        p.add_argument("--tls-ca", help="PEM CA of the daemon's certificate (TLS)")
        p.add_argument("--tls-cert", help="PEM client certificate (mutual TLS)")
        p.add_argument("--tls-key", help="PEM key of --tls-cert")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)  # every flag checked: a misspelt one is an error, not ignored
    try:
        if args.cmd == "stats":
            return print_stats(args.address, args.deadline, _client_auth(args))
        if args.cmd == "health":
            return check_health(args.address, args.deadline, _client_auth(args))
        if args.cmd == "trace":
            return trace_command(args)
        if args.cmd == "advise":
            from kvstore.advise_report import run

            return run(args)
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        rest = argv[argv.index("serve") + 1 :]
        if "--log-level" in rest:
            i = rest.index("--log-level")
            del rest[i : i + 2]
        cfg = load_config(rest)
        if args.check_config:
            print(f"kvstore: configuration OK\n{describe(cfg)}")
            return 0
        from kvstore.server import serve

        return serve(cfg)
    except (KVStoreError, TierKVError) as e:
        print(f"kvstore: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
