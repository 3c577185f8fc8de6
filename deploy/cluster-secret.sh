#!/usr/bin/env bash
# Makes the per-role cluster secrets docker-compose.yml gives the Spillway
# containers: one secret per role in deploy/cluster-secrets/<role> (32 random
# bytes from the kernel, base64, readable by the owner only), each mounted
# only in that role's containers (read through SPILLWAY_CLUSTER__SECRET_FILE),
# and deploy/cluster-verifiers.env, every role's verifier (the SHA-256 of its
# secret, SPILLWAY_CLUSTER__VERIFIERS__<ROLE>), which every container gets:
# a verifier proves a caller's role without letting its holder pose as it.
# So a compromised gateway holds the gateway's secret only, and can call the
# engine's session stream and nothing else (docs/security.md). The files are
# git-ignored: every machine makes its own, and none is ever committed.
#
#   deploy/cluster-secret.sh            make them if any is missing (make
#                                       images, the compose scripts)
#   deploy/cluster-secret.sh --rotate   replace them all; then recreate every
#                                       Spillway container at once
#                                       (docker-compose up -d --force-recreate)
set -euo pipefail
deploy="$(cd "$(dirname "$0")" && pwd)"
dir="$deploy/cluster-secrets"
verifiers="$deploy/cluster-verifiers.env"
roles=(gateway engine storage management)
complete=yes
for role in "${roles[@]}"; do
    [[ -s "$dir/$role" ]] || complete=no
done
[[ -s "$verifiers" ]] || complete=no
case "${1:-}" in
    "") [[ "$complete" == yes ]] && exit 0 ;;
    --rotate) ;;
    *) echo "usage: $0 [--rotate]" >&2; exit 2 ;;
esac
umask 077
mkdir -p "$dir"
tmp="$(mktemp -d "$deploy/.cluster-secrets.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
{
    echo "# Made by deploy/cluster-secret.sh: the SHA-256 of each role's secret."
    for role in "${roles[@]}"; do
        head -c 32 /dev/urandom | base64 | tr -d '\n' >"$tmp/$role"
        verifier="$(sha256sum <"$tmp/$role" | cut -d' ' -f1)"
        echo >>"$tmp/$role"
        echo "SPILLWAY_CLUSTER__VERIFIERS__${role^^}=$verifier"
    done
} >"$tmp/verifiers.env"
for role in "${roles[@]}"; do
    mv "$tmp/$role" "$dir/$role"
done
# Not secret, but made with the secrets: readable so that compose can pass it.
chmod 644 "$tmp/verifiers.env"
mv "$tmp/verifiers.env" "$verifiers"
echo "cluster-secret: wrote new per-role secrets to $dir and their verifiers to $verifiers"
