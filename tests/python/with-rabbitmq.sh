#!/usr/bin/env bash
# Run a command against a private, throw-away RabbitMQ node (Debian's rabbitmq-server),
# e.g. to check that the interop suite encodes real broker behaviour:
#
#   tests/python/with-rabbitmq.sh .venv/bin/pytest tests/python -q
#
# The node listens on a free port, keeps everything in a temp dir, and is stopped
# (and the temp dir removed) when the command ends. SPILLWAY_TEST_AMQP_URL is set for
# the command. Several runs may go at once.
set -euo pipefail

RABBIT_BIN="${RABBIT_BIN:-/usr/lib/rabbitmq/bin}"
[[ -x "$RABBIT_BIN/rabbitmq-server" ]] || { echo "with-rabbitmq: no rabbitmq-server in $RABBIT_BIN" >&2; exit 1; }

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

tmp="$(mktemp -d -t spillway-rabbit.XXXXXX)"
port="$(free_port)"
dist_port="$(free_port)"
http_port="$(free_port)"
node="pytest-$$@localhost"
epmd_was_running=0
epmd -names >/dev/null 2>&1 && epmd_was_running=1

export HOME="$tmp"                     # private Erlang cookie
export RABBITMQ_NODENAME="$node"
export RABBITMQ_NODE_IP_ADDRESS=127.0.0.1
export RABBITMQ_NODE_PORT="$port"
export RABBITMQ_DIST_PORT="$dist_port"
export RABBITMQ_MNESIA_BASE="$tmp/mnesia"
export RABBITMQ_LOG_BASE="$tmp/log"
export RABBITMQ_CONFIG_FILE="$tmp/rabbitmq"
export RABBITMQ_ENABLED_PLUGINS_FILE="$tmp/enabled_plugins"
export RABBITMQ_PID_FILE="$tmp/rabbit.pid"
mkdir -p "$tmp/mnesia" "$tmp/log"
# The management plugin: its HTTP API is what test_http_api.py holds Spillway's to.
echo "[rabbitmq_management]." > "$tmp/enabled_plugins"
cat > "$tmp/rabbitmq.conf" <<CONF
listeners.tcp.default = 127.0.0.1:$port
management.tcp.ip = 127.0.0.1
management.tcp.port = $http_port
collect_statistics_interval = 1000
log.console = false
log.file.level = info
CONF

server_pid=
cleanup() {
    rc=$?
    if [[ -n "$server_pid" ]] && kill -0 "$server_pid" 2>/dev/null; then
        "$RABBIT_BIN/rabbitmqctl" -n "$node" stop >/dev/null 2>&1 || true
        for _ in $(seq 1 50); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.2; done
        kill -KILL "$server_pid" 2>/dev/null || true
        wait "$server_pid" 2>/dev/null || true
    fi
    # epmd is started by the node as a daemon; stop it only if we caused it and no node is left.
    if [[ $epmd_was_running -eq 0 ]] && ! epmd -names 2>/dev/null | grep -q '^name '; then
        epmd -kill >/dev/null 2>&1 || true
    fi
    if [[ $rc -ne 0 && -d "$tmp/log" ]]; then
        echo "with-rabbitmq: RabbitMQ logs in $tmp/log kept" >&2
    else
        rm -rf "$tmp"
    fi
    exit $rc
}
trap cleanup EXIT INT TERM

"$RABBIT_BIN/rabbitmq-server" >"$tmp/log/stdout.log" 2>&1 &
server_pid=$!
started=0
for _ in $(seq 1 60); do
    kill -0 "$server_pid" 2>/dev/null || break
    # await_startup fails at once while the node has not registered with epmd yet.
    if timeout 60 "$RABBIT_BIN/rabbitmqctl" -n "$node" await_startup >/dev/null 2>&1; then started=1; break; fi
    sleep 1
done
if [[ $started -ne 1 ]]; then
    echo "with-rabbitmq: RabbitMQ did not start; see $tmp/log" >&2
    tail -n 30 "$tmp/log/stdout.log" >&2 || true
    exit 1
fi
echo "with-rabbitmq: RabbitMQ $node on 127.0.0.1:$port" >&2

export SPILLWAY_TEST_AMQP_URL="amqp://guest:guest@127.0.0.1:$port/%2F"
export SPILLWAY_TEST_HTTP_URL="http://127.0.0.1:$http_port"
# The command must not inherit the private HOME.
HOME="$(getent passwd "$(id -u)" | cut -d: -f6)" "$@"
