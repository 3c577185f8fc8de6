#!/usr/bin/env bash
# A stand-in for the spillway binary that runs RabbitMQ instead, following the same
# start contract (--ready-file FILE, SPILLWAY_* environment, SIGTERM = graceful stop).
# It lets the restart/SIGKILL tests and the harness itself be checked against a real
# broker:
#
#   SPILLWAY_BIN=tests/python/rabbitmq-as-spillway.sh .venv/bin/pytest tests/python -q
#
# For the separate wiring, "storage" and "engine" are placeholders that only bind their
# gRPC address and check their wiring, and "gateway" runs RabbitMQ: that exercises the
# harness (start order, addresses, restart_storage on the same port), not durability
# across a storage restart.
set -euo pipefail

RABBIT_BIN="${RABBIT_BIN:-/usr/lib/rabbitmq/bin}"
ready=""
role="all-in-one"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --ready-file) ready="$2"; shift 2 ;;
        --ready-file=*) ready="${1#*=}"; shift ;;
        *) role="$1"; shift ;;
    esac
done
[[ -n "$ready" ]] || { echo "rabbitmq-as-spillway: --ready-file is required" >&2; exit 2; }

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

placeholder() {  # placeholder KEY LISTEN: bind LISTEN, write {"KEY": addr}, wait for SIGTERM
    exec python3 -c '
import json, os, signal, socket, sys
key, listen, ready = sys.argv[1:4]
host, _, port = listen.rpartition(":")
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((host, int(port)))
s.listen()
h, p = s.getsockname()
with open(ready + ".tmp", "w") as f:
    json.dump({key: f"{h}:{p}"}, f)
os.rename(ready + ".tmp", ready)
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
while True:
    s.accept()[0].close()
' "$1" "$2" "$ready"
}

case "$role" in
    all-in-one) ;;
    storage)
        [[ -n "${SPILLWAY_STORAGE__DATA_DIR:-}" ]] || { echo "storage: no data dir" >&2; exit 2; }
        placeholder storage "${SPILLWAY_STORAGE__LISTEN:-127.0.0.1:0}" ;;
    engine)
        [[ "${SPILLWAY_ENGINE__STORAGE_ADDR:-}" == http://127.0.0.1:* ]] || { echo "engine: bad SPILLWAY_ENGINE__STORAGE_ADDR" >&2; exit 2; }
        placeholder engine "${SPILLWAY_ENGINE__LISTEN:-127.0.0.1:0}" ;;
    gateway)
        [[ "${SPILLWAY_GATEWAY__ENGINE_ADDR:-}" == http://127.0.0.1:* ]] || { echo "gateway: bad SPILLWAY_GATEWAY__ENGINE_ADDR" >&2; exit 2; }
        SPILLWAY_STORAGE__DATA_DIR="$PWD/rabbit-data" ;;
    *) echo "rabbitmq-as-spillway: unknown role $role" >&2; exit 2 ;;
esac

mkdir -p "${SPILLWAY_STORAGE__DATA_DIR:?SPILLWAY_STORAGE__DATA_DIR must be set}"
data="$(realpath "$SPILLWAY_STORAGE__DATA_DIR")"
mkdir -p "$data/mnesia" "$data/log"
listen="${SPILLWAY_GATEWAY__AMQP_LISTEN:-127.0.0.1:0}"
port="${listen##*:}"
[[ "$port" != "0" ]] || port="$(free_port)"
# The node name must stay the same across restarts on one data dir.
node="spillshim-$(printf '%s' "$data" | sha1sum | cut -c1-12)@localhost"

export HOME="$data"     # Erlang cookie kept with the data
export RABBITMQ_NODENAME="$node"
export RABBITMQ_NODE_IP_ADDRESS=127.0.0.1
export RABBITMQ_NODE_PORT="$port"
export RABBITMQ_DIST_PORT="$(free_port)"
export RABBITMQ_MNESIA_BASE="$data/mnesia"
export RABBITMQ_LOG_BASE="$data/log"
export RABBITMQ_CONFIG_FILE="$data/rabbitmq"
export RABBITMQ_ENABLED_PLUGINS_FILE="$data/enabled_plugins"
export RABBITMQ_PID_FILE="$data/rabbit.pid"
echo "[]." > "$data/enabled_plugins"
printf 'listeners.tcp.default = 127.0.0.1:%s\nlog.console = false\n' "$port" > "$data/rabbitmq.conf"

"$RABBIT_BIN/rabbitmq-server" >>"$data/log/stdout.log" 2>&1 &
pid=$!
trap 'kill -TERM $pid 2>/dev/null; wait $pid; exit 0' TERM INT

for _ in $(seq 1 60); do
    kill -0 "$pid" 2>/dev/null || { echo "rabbitmq-as-spillway: RabbitMQ exited" >&2; tail -n 20 "$data/log/stdout.log" >&2; exit 1; }
    if timeout 60 "$RABBIT_BIN/rabbitmqctl" -n "$node" await_startup >/dev/null 2>&1; then
        printf '{"amqp":"127.0.0.1:%s"}\n' "$port" > "$ready.tmp"
        mv "$ready.tmp" "$ready"
        echo "rabbitmq-as-spillway: $node ready on 127.0.0.1:$port" >&2
        wait "$pid"
        exit $?
    fi
    sleep 1
done
echo "rabbitmq-as-spillway: RabbitMQ did not start" >&2
exit 1
