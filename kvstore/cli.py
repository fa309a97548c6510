"""``kvstore serve [flags]`` runs the daemon (``--check-config``: validate and exit);
``kvstore stats --address ADDR`` prints a table; ``kvstore health --address ADDR`` exits 0 when the
daemon answers SERVING on gRPC health (container health checks), and names the tiers that are
detached (the daemon serves degraded: still exit 0, see kvstore/health.py)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from kvstore import auth
from kvstore.auth import ClientAuth
from kvstore.config import KINDS, StoreConfig, build_arg_parser, load_config
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
    cols = ("tier", "used", "capacity", "blocks", "hits", "misses", "evict", "spills", "promo", "dropped", "errors",
            "refused", "state", "detach", "attach", "skipped")  # fmt: skip
    rows = [
        (t.name, _fmt_bytes(t.used_bytes), _fmt_bytes(t.capacity_bytes), t.blocks, t.hits, t.misses, t.evictions,
         t.spills, t.promotions, t.dropped, t.errors, t.refused, "attached" if t.available else "DETACHED",
         t.detaches, t.attaches, t.skipped_writes)
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
    from kvstore.health import TIER_SERVICE

    with KVStoreClient(address, deadline_s=deadline_s, use_shm=False, auth=auth) as c:
        ok = c.health()
        detached = [k for k in KINDS if ok and c.health_status(TIER_SERVICE + k) == "NOT_SERVING"]
    print(("SERVING" if ok else "NOT SERVING") + (f" (degraded: {', '.join(detached)} detached)" if detached else ""))
    return 0 if ok else 1


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
    for p in (stats_p, health_p):
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
