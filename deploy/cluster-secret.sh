#!/usr/bin/env bash
# Makes deploy/cluster-secret, the cluster secret docker-compose.yml gives
# every Spillway container (read through SPILLWAY_CLUSTER__SECRET_FILE): 32
# random bytes from the kernel, base64, readable by the owner only. The file
# is git-ignored: every machine makes its own, and none is ever committed.
#
#   deploy/cluster-secret.sh            make it if it is missing (make images,
#                                       the compose scripts)
#   deploy/cluster-secret.sh --rotate   replace it; then recreate every
#                                       Spillway container at once
#                                       (docker-compose up -d --force-recreate)
set -euo pipefail
file="$(cd "$(dirname "$0")" && pwd)/cluster-secret"
case "${1:-}" in
    "") [[ -s "$file" ]] && exit 0 ;;
    --rotate) ;;
    *) echo "usage: $0 [--rotate]" >&2; exit 2 ;;
esac
umask 077
tmp="$(mktemp "$file.XXXXXX")"
trap 'rm -f "$tmp"' EXIT
head -c 32 /dev/urandom | base64 | tr -d '\n' >"$tmp"
echo >>"$tmp"
mv "$tmp" "$file"
trap - EXIT
echo "cluster-secret: wrote a new secret to $file"
