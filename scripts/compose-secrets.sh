#!/usr/bin/env bash
# The secrets docker-compose.yml reads, as files in ./secrets/ (ignored by git): made with random
# hex values when missing, never overwritten (the MAC secret must stay the one the stored blocks
# were signed with; to roll it, see docs/operations.md, "Shared tiers: signed blocks").
#
#   scripts/compose-secrets.sh [DIR]        (default: ./secrets next to docker-compose.yml)
#
# The directory is 0700, so on the host only its owner reaches the files. The files themselves are
# 0644: compose bind-mounts each one into /run/secrets/ as it is, and the services run as their
# own users (the daemon as uid 10001), which must be able to read them there.
set -euo pipefail

dir="${1:-$(cd "$(dirname "$0")/.." && pwd)/secrets}"
mkdir -p "$dir"
chmod 0700 "$dir"
# tierkv_*token*: the daemon's bearer tokens (deploy/compose-credentials.yaml maps them to tenants)
for name in redis_password s3_access_key_id s3_secret_access_key mac_secret \
            tierkv_admin_token tierkv_token_alpha tierkv_token_beta tierkv_token_gamma; do
    f="$dir/$name"
    if [ ! -s "$f" ]; then
        bytes=32
        [ "$name" = s3_access_key_id ] && bytes=10
        (umask 022 && od -An -vtx1 -N"$bytes" /dev/urandom | tr -d ' \n' > "$f")
        echo "compose-secrets: made $f"
    fi
    chmod 0644 "$f"
done
