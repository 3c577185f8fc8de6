#!/usr/bin/env bash
# Makes the compose deployment's first administrator on this machine, never
# in the repository: a random password for the user `spillway`, written to
#   deploy/users.toml    the seed of an empty store, mounted read-only into
#                        the engine (read on the first start only)
#   deploy/loadgen.env   the load generators' URLs with that password
#   deploy/admin-password the password alone, readable by the owner only
# All three are git-ignored. Run by `make images` and the compose scripts;
# it keeps what exists, so a volume seeded with the password keeps working.
#
#   deploy/admin-credentials.sh           make them if missing
#   deploy/admin-credentials.sh --show    print the user and password
set -euo pipefail
dir="$(cd "$(dirname "$0")" && pwd)"
password_file="$dir/admin-password"
case "${1:-}" in
    "") ;;
    --show) echo "spillway $(cat "$password_file")"; exit 0 ;;
    *) echo "usage: $0 [--show]" >&2; exit 2 ;;
esac
umask 077
if [[ ! -s "$password_file" ]]; then
    # 24 characters a URL, TOML and a shell take as they are.
    head -c 64 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' | head -c 24 >"$password_file"
    echo >>"$password_file"
    echo "admin-credentials: made a password for 'spillway' in $password_file"
fi
password="$(tr -d '\n' <"$password_file")"
# The engine container reads users.toml as another user than this one.
umask 022
cat >"$dir/users.toml" <<TOML
# Made by deploy/admin-credentials.sh on this machine (git-ignored): the seed
# of the user database, read by the engine when the store has no users yet
# (the first start on an empty volume); afterwards users live in the store
# (\`spillctl user\`). The password is in deploy/admin-password.
[[engine.users]]
name = "spillway"
password = "$password"
tags = ["administrator"]
TOML
umask 077
cat >"$dir/loadgen.env" <<ENV
SPILLWAY_LOADGEN_URL=amqps://spillway:$password@gateway:5671/%2f
SPILLWAY_LOADGEN_CONSUMER_URL=amqp://spillway:$password@gateway2:5672/%2f
ENV
