"""``kvstore serve [flags]`` runs the daemon (``--check-config``: validate and exit);
``kvstore stats --address ADDR [--json] [--watch S]`` prints per-tier statistics; ``kvstore health
--address ADDR`` exits 0 when the daemon answers SERVING on gRPC health (container health checks),
and names the tiers that are detached (the daemon serves degraded: still exit 0, see
kvstore/server/health.py); ``kvstore trace start|stop`` records the daemon's accesses to a file and
``kvstore advise TRACE`` sizes each tier from it (kvstore/ops/advise.py). A bad value anywhere is one
line on stderr and exit 2; ``--version`` prints the package version."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

from kvstore.config import tier_secrets
from kvstore.config.flags import build_arg_parser
from kvstore.config.store_config import KINDS, StoreConfig
from kvstore.errors import KVStoreError
from kvstore.ops import stats_view
from kvstore.server import auth
from kvstore.server.auth import ClientAuth
from tiers.errors import TierKVError

log = logging.getLogger("kvstore")


def package_version() -> str:
    try:
        return version("tierkv")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _client_auth(args: argparse.Namespace) -> ClientAuth:
    """Health sends no token (the daemon exempts it: it works before the token file exists)."""
    return ClientAuth.from_env(token_file=getattr(args, "token_file", None) or "", tls_ca=args.tls_ca or "",
                               tls_cert=args.tls_cert or "", tls_key=args.tls_key or "",
                               with_token=args.cmd != "health")  # fmt: skip


def print_stats(address: str, deadline_s: float, auth: ClientAuth | None = None, as_json: bool = False,
                watch_s: float = 0.0) -> int:
    """Print the daemon's stats once, or every ``watch_s`` seconds until Ctrl-C (exit 0)."""
    from kvstore.client.client import KVStoreClient

    stop = threading.Event()
    if watch_s and threading.current_thread() is threading.main_thread():
        # Ctrl-C ends the loop between refreshes: a KeyboardInterrupt raised inside a gRPC call or
        # the channel's close could leave the process hanging instead of exiting
        previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
    else:
        previous = None
    try:
        with KVStoreClient(address, deadline_s=deadline_s, use_shm=False, auth=auth) as c:
            while True:
                st = c.stats()
                if as_json:
                    print(stats_view.as_json(st, address), flush=True)
                else:
                    if watch_s and sys.stdout.isatty():
                        print("\033[H\033[2J", end="")  # clear the screen between refreshes
                    print(stats_view.table(st), flush=True)
                if not watch_s or stop.wait(watch_s):
                    return 0
                if not as_json:
                    print(flush=True)
    except KeyboardInterrupt:
        return 0
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def check_health(address: str, deadline_s: float, auth: ClientAuth | None = None) -> int:
    from kvstore.client.client import KVStoreClient
    from kvstore.server.health import TIER_SERVICE

    with KVStoreClient(address, deadline_s=deadline_s, use_shm=False, auth=auth) as c:
        ok = c.health()
        detached = [k for k in KINDS if ok and c.health_status(TIER_SERVICE + k) == "NOT_SERVING"]
    print(("SERVING" if ok else "NOT SERVING") + (f" (degraded: {', '.join(detached)} detached)" if detached else ""))
    return 0 if ok else 1


def trace_command(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvstore.client.client import KVStoreClient

    with KVStoreClient(args.address, deadline_s=args.deadline, use_shm=False, auth=_client_auth(args)) as c:
        if args.action == "start":  # a bare name is a file in the daemon's traces dir; a path, from here
            out = args.out or ""
            path = c.trace_start(str(Path(out).absolute()) if os.sep in out else out, args.max_records)
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
    lines += tier_secrets.describe(cfg)
    return "\n".join(lines)


def _serve(argv: list[str], args: argparse.Namespace) -> int:
    from kvstore.config.store_config import effective_lines, load_settings

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rest = argv[argv.index("serve") + 1 :]
    if "--log-level" in rest:
        i = rest.index("--log-level")
        del rest[i : i + 2]
    settings = load_settings(rest)
    if args.check_config:
        print(f"kvstore: configuration OK\n{describe(settings.config)}")
        return 0
    log.info("kvstore %s, effective configuration (value  (source); secrets masked):", package_version())
    for line in effective_lines(settings):
        log.info("config %s", line)
    from kvstore.server.daemon import serve

    return serve(settings.config)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstore", description="tierkv KV-cache daemon")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="cmd", required=True)
    serve_p = sub.add_parser("serve", help="run the daemon", add_help=False,
                             epilog="Precedence per field: flag > TIERKV_* env > YAML > default; sizes: Gi = 2^30, "
                             "G = 10^9, bare numbers are bytes (docs/operations.md).")
    build_arg_parser(serve_p)
    serve_p.add_argument("-h", "--help", action="help", help="show this help and exit")
    serve_p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR (default: %(default)s)")
    fmt = argparse.ArgumentDefaultsHelpFormatter
    stats_p = sub.add_parser("stats", help="print the daemon's per-tier statistics", formatter_class=fmt)
    stats_p.add_argument("--address", default="127.0.0.1:50551", help="the daemon's HOST:PORT")
    stats_p.add_argument("--deadline", type=float, default=5.0, help="seconds to wait for the daemon")
    stats_p.add_argument("--json", action="store_true", help="one JSON object per refresh (stable keys)")
    stats_p.add_argument("--watch", type=_positive, default=0.0, metavar="SECONDS",
                         help="refresh every SECONDS until Ctrl-C (0 = print once)")
    health_p = sub.add_parser("health", help="exit 0 if the daemon is serving (gRPC health check)", formatter_class=fmt)
    health_p.add_argument("--address", default="127.0.0.1:50551", help="the daemon's HOST:PORT")
    health_p.add_argument("--deadline", type=float, default=3.0, help="seconds to wait for the daemon")
    stats_p.add_argument("--token-file", help="bearer token file (default: TIERKV_TOKEN, TIERKV_TOKEN_FILE, "
                         "then the daemon's default token file on this machine)")
    trace_p = sub.add_parser("trace", help="start or stop recording the daemon's accesses (for `kvstore advise`)")
    trace_p.add_argument("action", choices=("start", "stop"))
    trace_p.add_argument("--out", help="trace file (start): a name in the daemon's traces directory (--traces-dir), "
                         "or a path in it; default: a new name there")
    trace_p.add_argument("--max-records", type=int, default=0,
                         help="ring size: older records are overwritten (start; default 1000000, 24 bytes each, "
                         "at most the daemon's trace_max_records)")
    trace_p.add_argument("--address", default="127.0.0.1:50551", help="the daemon's HOST:PORT")
    trace_p.add_argument("--deadline", type=float, default=30.0, help="seconds to wait for the daemon")
    trace_p.add_argument("--token-file", help="bearer token file (as for stats)")
    advise_p = sub.add_parser("advise", help="miss-ratio curves and tier sizes from a trace")
    from kvstore.ops.advise_report import add_arguments

    add_arguments(advise_p)
    for p in (stats_p, health_p, trace_p):
        p.add_argument("--tls-ca", help="PEM CA of the daemon's certificate (TLS; env TIERKV_TLS_CA)")
        p.add_argument("--tls-cert", help="PEM client certificate (mutual TLS; env TIERKV_CLIENT_CERT)")
        p.add_argument("--tls-key", help="PEM key of --tls-cert (env TIERKV_CLIENT_KEY)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)  # every flag checked: a misspelt one is an error, not ignored
    try:
        if args.cmd == "stats":
            return print_stats(args.address, args.deadline, _client_auth(args), args.json, args.watch)
        if args.cmd == "health":
            return check_health(args.address, args.deadline, _client_auth(args))
        if args.cmd == "trace":
            return trace_command(args)
        if args.cmd == "advise":
            from kvstore.ops.advise_report import run

            return run(args)
        return _serve(argv, args)
    except (KVStoreError, TierKVError) as e:
        for line in str(e).splitlines() or [type(e).__name__]:
            print(f"kvstore: {line}", file=sys.stderr)
        return 2


def _positive(value: str) -> float:
    seconds = float(value)
    if seconds < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {value}")
    return seconds


if __name__ == "__main__":
    sys.exit(main())
