# shellcheck shell=bash
# Start and stop Spillway (all-in-one or as separate processes) and a private RabbitMQ
# node for tests and benchmarks. Source this file from bash:
#
#   . scripts/lib/spillway-procs.sh
#   trap stop_all EXIT
#   start_spillway_all_in_one      # sets BROKER_URL, SPILLWAY_AMQP_ADDR, SPILLWAY_MGMT_ADDR
#   ...; stop_spillway
#   start_spillway_separate        # storage, engine, gateway as three processes
#   ...; stop_spillway
#   start_rabbitmq                 # private node on free ports; sets BROKER_URL, RABBITMQ_URL
#   ...; stop_rabbitmq
#
# Every process is started with setsid in its own process group and recorded; stop_* and
# stop_all signal those groups only (never a process found by name). All state lives under
# one temp dir ($SPW_WORKDIR, removed by stop_all unless SPW_KEEP_WORKDIR=1).
# The brokers are background jobs of the sourcing shell: use `wait PID`, never a bare
# `wait` (it would wait for the brokers too).
#
# Settings (environment):
#   SPILLWAY_BIN           spillway binary (default: <repo>/target/release/spillway)
#   SPW_READY_TIMEOUT      seconds to wait for a ready file / broker start (default 60)
#   SPW_WORKDIR            temp dir to use (default: mktemp -d)
#   SPW_KEEP_WORKDIR=1     keep the temp dir (logs) after stop_all
#   SPW_QUIET=1            no progress messages on stderr
#   SPW_SEPARATE_MANAGEMENT=1  start_spillway_separate also starts the management process
#   SPW_RABBIT_PLUGINS     plugins start_rabbitmq enables (space-separated, e.g. rabbitmq_amqp1_0;
#                          default none)
#   Any SPILLWAY_* setting you export is passed on to the spillway processes.

SPW_LIB_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SPW_REPO_ROOT="$(cd "$SPW_LIB_DIR/../.." && pwd)"
: "${SPILLWAY_BIN:=$SPW_REPO_ROOT/target/release/spillway}"
: "${SPW_READY_TIMEOUT:=60}"

SPW_SPILLWAY_PGIDS=()   # process groups of the spillway processes we started
SPW_RABBIT_PGIDS=()     # process groups of rabbitmq-server and its epmd
SPW_RABBIT_ENV=()       # env (VAR=value) that rabbitmqctl needs to reach our node

spw_log() { [ "${SPW_QUIET:-0}" = 1 ] || echo "[spillway-procs] $*" >&2; }
spw_die() { echo "[spillway-procs] ERROR: $*" >&2; return 1; }

# spw_workdir: make sure $SPW_WORKDIR exists (call directly, not in $(...)).
spw_workdir() {
    if [ -z "${SPW_WORKDIR:-}" ]; then
        SPW_WORKDIR="$(mktemp -d "${TMPDIR:-/tmp}/spillway-procs.XXXXXX")" || return 1
        SPW_WORKDIR_OWNED=1
    fi
    mkdir -p "$SPW_WORKDIR"
}

# json_get FILE_OR_STRING KEY -> value of a top-level "KEY" in flat JSON (string unquoted).
json_get() {
    local src="$1" key="$2" text
    if [ -f "$src" ]; then text="$(cat "$src")"; else text="$src"; fi
    printf '%s' "$text" | tr -d '\n' |
        sed -n -E "s/.*\"$key\"[[:space:]]*:[[:space:]]*(\"([^\"]*)\"|([-+0-9.eE]+|true|false|null)).*/\2\3/p"
}

# port_is_free PORT: true when no TCP socket uses PORT as its local port: not a listener,
# and not a connection either (a connected socket's port cannot be bound to listen;
# RabbitMQ's distribution port once failed to start that way, dist_port_already_used).
port_is_free() {
    if command -v ss >/dev/null 2>&1; then
        ! ss -Htan "sport = :$1" 2>/dev/null | grep -q .
    else
        ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
    fi
}

# free_port [MIN [MAX]]: a currently free TCP port (random in range).
free_port() {
    local min="${1:-20000}" max="${2:-45000}" p i
    for i in $(seq 1 200); do
        p=$((min + RANDOM % (max - min)))
        if port_is_free "$p"; then echo "$p"; return 0; fi
    done
    spw_die "no free port found in $min-$max"
}

# spw_spawn LOGFILE CMD... : start CMD in a new session (own process group, so its pid is
# the group id); sets SPW_LAST_PID. Call directly, not in $(...).
spw_spawn() {
    local log="$1"; shift
    setsid "$@" >>"$log" 2>&1 </dev/null &
    SPW_LAST_PID=$!
}

spw_alive() { kill -0 "$1" 2>/dev/null; }

# spw_kill_group PGID [GRACE_SECONDS]: TERM the group, wait, then KILL what is left.
spw_kill_group() {
    local pg="$1" grace="${2:-10}" i
    [ -n "$pg" ] || return 0
    kill -TERM -- "-$pg" 2>/dev/null || kill -TERM "$pg" 2>/dev/null || return 0
    for i in $(seq 1 $((grace * 10))); do
        kill -0 -- "-$pg" 2>/dev/null || return 0
        sleep 0.1
    done
    spw_log "process group $pg still alive after ${grace}s: SIGKILL"
    kill -KILL -- "-$pg" 2>/dev/null || true
    # Reap it if it was our child.
    wait "$pg" 2>/dev/null || true
}

# spw_wait_ready FILE PID NAME LOG: wait until FILE exists (and PID lives).
spw_wait_ready() {
    local file="$1" pid="$2" name="$3" log="$4" deadline=$((SECONDS + SPW_READY_TIMEOUT))
    while [ ! -s "$file" ]; do
        if ! spw_alive "$pid"; then
            echo "---- last lines of $log ----" >&2; tail -n 30 "$log" >&2 2>/dev/null
            spw_die "$name exited before it was ready (log: $log)"; return 1
        fi
        if [ "$SECONDS" -ge "$deadline" ]; then
            echo "---- last lines of $log ----" >&2; tail -n 30 "$log" >&2 2>/dev/null
            spw_die "$name not ready after ${SPW_READY_TIMEOUT}s (log: $log)"; return 1
        fi
        sleep 0.1
    done
}

# spw_start_component NAME SUBCOMMAND [VAR=value...]: start one spillway process with the
# given extra environment; waits for its ready file and sets SPW_READY_FILE to its path.
spw_start_component() {
    local name="$1" sub="$2"; shift 2
    local dir ready log pid
    spw_workdir || return 1
    dir="$SPW_WORKDIR/$name"
    mkdir -p "$dir"
    ready="$dir/ready.json"; log="$dir/$name.log"
    rm -f "$ready"
    [ -x "$SPILLWAY_BIN" ] || { spw_die "spillway binary not found: $SPILLWAY_BIN (cargo build --release -p spillway)"; return 1; }
    spw_spawn "$log" env \
        SPILLWAY_GATEWAY__AMQP_LISTEN="${SPILLWAY_GATEWAY__AMQP_LISTEN:-127.0.0.1:0}" \
        SPILLWAY_STORAGE__LISTEN="${SPILLWAY_STORAGE__LISTEN:-127.0.0.1:0}" \
        SPILLWAY_ENGINE__LISTEN="${SPILLWAY_ENGINE__LISTEN:-127.0.0.1:0}" \
        SPILLWAY_MANAGEMENT__LISTEN="${SPILLWAY_MANAGEMENT__LISTEN:-127.0.0.1:0}" \
        SPILLWAY_MANAGEMENT__HTTP_LISTEN="${SPILLWAY_MANAGEMENT__HTTP_LISTEN:-127.0.0.1:0}" \
        SPILLWAY_TELEMETRY__METRICS_LISTEN="${SPILLWAY_TELEMETRY__METRICS_LISTEN:-127.0.0.1:0}" \
        SPILLWAY_STORAGE__DATA_DIR="${SPILLWAY_STORAGE__DATA_DIR:-$dir/data}" \
        "$@" "$SPILLWAY_BIN" --ready-file "$ready" "$sub"
    pid=$SPW_LAST_PID
    SPW_SPILLWAY_PGIDS+=("$pid")
    spw_log "started spillway $sub (pid $pid, log $log)"
    spw_wait_ready "$ready" "$pid" "spillway $sub" "$log" || return 1
    SPW_READY_FILE="$ready"
}

spw_set_broker() {
    SPILLWAY_AMQP_ADDR="$1"
    BROKER_URL="amqp://guest:guest@$1/%2f"
    export SPILLWAY_AMQP_ADDR BROKER_URL
}

# start_spillway_all_in_one: every component in one process (embedded storage).
start_spillway_all_in_one() {
    local ready amqp
    spw_start_component all-in-one all-in-one || return 1
    ready="$SPW_READY_FILE"
    amqp="$(json_get "$ready" amqp)"
    [ -n "$amqp" ] || { spw_die "no \"amqp\" address in $ready: $(cat "$ready")"; return 1; }
    SPILLWAY_MGMT_ADDR="$(json_get "$ready" management)"; export SPILLWAY_MGMT_ADDR
    spw_set_broker "$amqp"
    spw_log "spillway all-in-one ready: amqp $amqp"
}

# start_spillway_separate: storage, then engine (-> storage), then gateway (-> engine), and
# with SPW_SEPARATE_MANAGEMENT=1 management (-> storage). Sets SPILLWAY_STORAGE_ADDR,
# SPILLWAY_ENGINE_ADDR, SPILLWAY_AMQP_ADDR, SPILLWAY_MGMT_ADDR (when one runs), BROKER_URL.
start_spillway_separate() {
    local ready storage engine amqp secret
    # One cluster secret for the roles of this broker: each component has a
    # data directory of its own here, where a role without a configured
    # secret would make (and trust) its own.
    spw_workdir || return 1
    secret="$SPW_WORKDIR/cluster-secret"
    if [ ! -s "$secret" ]; then
        (umask 077; head -c 32 /dev/urandom | base64 | tr -d '\n' >"$secret") || return 1
    fi
    spw_start_component storage storage SPILLWAY_CLUSTER__SECRET_FILE="$secret" || return 1
    ready="$SPW_READY_FILE"
    storage="$(json_get "$ready" storage)"
    [ -n "$storage" ] || { spw_die "no \"storage\" address in $ready"; return 1; }
    SPILLWAY_STORAGE_ADDR="$storage"; export SPILLWAY_STORAGE_ADDR

    spw_start_component engine engine SPILLWAY_CLUSTER__SECRET_FILE="$secret" \
        SPILLWAY_ENGINE__STORAGE_ADDR="http://$storage" || return 1
    ready="$SPW_READY_FILE"
    engine="$(json_get "$ready" engine)"
    [ -n "$engine" ] || { spw_die "no \"engine\" address in $ready"; return 1; }
    SPILLWAY_ENGINE_ADDR="$engine"; export SPILLWAY_ENGINE_ADDR
    # Management may run inside the engine process; take it from whichever reports it.
    SPILLWAY_MGMT_ADDR="$(json_get "$ready" management)"

    spw_start_component gateway gateway SPILLWAY_CLUSTER__SECRET_FILE="$secret" \
        SPILLWAY_GATEWAY__ENGINE_ADDR="http://$engine" || return 1
    ready="$SPW_READY_FILE"
    amqp="$(json_get "$ready" amqp)"
    [ -n "$amqp" ] || { spw_die "no \"amqp\" address in $ready"; return 1; }
    [ -n "$SPILLWAY_MGMT_ADDR" ] || SPILLWAY_MGMT_ADDR="$(json_get "$ready" management)"

    if [ "${SPW_SEPARATE_MANAGEMENT:-0}" = 1 ] && [ -z "$SPILLWAY_MGMT_ADDR" ]; then
        spw_start_component management management SPILLWAY_CLUSTER__SECRET_FILE="$secret" \
            SPILLWAY_MANAGEMENT__STORAGE_ADDR="http://$storage" || return 1
        SPILLWAY_MGMT_ADDR="$(json_get "$SPW_READY_FILE" management)"
    fi
    export SPILLWAY_MGMT_ADDR
    spw_set_broker "$amqp"
    spw_log "spillway separate ready: storage $storage, engine $engine, amqp $amqp"
}

# start_spillway_group: a storage group of SPW_GROUP_SIZE (3) storage nodes on loopback
# (docs/replication.md), an engine that knows them all, and a gateway. Sets the same
# variables as start_spillway_separate (SPILLWAY_STORAGE_ADDR: the first member).
start_spillway_group() {
    local size="${SPW_GROUP_SIZE:-3}" secret i port ports=() members=() addrs="" ready engine amqp
    spw_workdir || return 1
    secret="$SPW_WORKDIR/cluster-secret"
    if [ ! -s "$secret" ]; then
        (umask 077; head -c 32 /dev/urandom | base64 | tr -d '\n' >"$secret") || return 1
    fi
    # The members must know each other's addresses before they start: distinct free ports
    # below the kernel's ephemeral range.
    while [ "${#ports[@]}" -lt "$size" ]; do
        port="$(free_port 10000 20000)" || return 1
        case " ${ports[*]} " in *" $port "*) continue ;; esac
        ports+=("$port")
    done
    for i in $(seq 1 "$size"); do
        members+=("SPILLWAY_STORAGE__MEMBERS__$i=http://127.0.0.1:${ports[$((i - 1))]}")
        addrs="${addrs:+$addrs,}http://127.0.0.1:${ports[$((i - 1))]}"
    done
    for i in $(seq 1 "$size"); do
        SPILLWAY_STORAGE__LISTEN="127.0.0.1:${ports[$((i - 1))]}" \
            spw_start_component "storage-$i" storage SPILLWAY_CLUSTER__SECRET_FILE="$secret" \
            SPILLWAY_STORAGE__NODE_ID="$i" "${members[@]}" || return 1
    done
    SPILLWAY_STORAGE_ADDR="127.0.0.1:${ports[0]}"; export SPILLWAY_STORAGE_ADDR
    spw_start_component engine engine SPILLWAY_CLUSTER__SECRET_FILE="$secret" \
        SPILLWAY_ENGINE__STORAGE_ADDRS="$addrs" || return 1
    ready="$SPW_READY_FILE"
    engine="$(json_get "$ready" engine)"
    [ -n "$engine" ] || { spw_die "no \"engine\" address in $ready"; return 1; }
    SPILLWAY_ENGINE_ADDR="$engine"; export SPILLWAY_ENGINE_ADDR
    spw_start_component gateway gateway SPILLWAY_CLUSTER__SECRET_FILE="$secret" \
        SPILLWAY_GATEWAY__ENGINE_ADDR="http://$engine" || return 1
    amqp="$(json_get "$SPW_READY_FILE" amqp)"
    [ -n "$amqp" ] || { spw_die "no \"amqp\" address in $SPW_READY_FILE"; return 1; }
    spw_set_broker "$amqp"
    spw_log "spillway group of $size ready: storage $addrs, engine $engine, amqp $amqp"
}

stop_spillway() {
    local pg i
    # Stop in reverse start order (gateway, engine, storage).
    for ((i = ${#SPW_SPILLWAY_PGIDS[@]} - 1; i >= 0; i--)); do
        pg="${SPW_SPILLWAY_PGIDS[$i]}"
        spw_kill_group "$pg" 15
    done
    SPW_SPILLWAY_PGIDS=()
}

# ---------------------------------------------------------------------------- RabbitMQ
: "${RABBITMQ_HOME_DIR:=/usr/lib/rabbitmq}"

spw_rabbit_bin() { echo "$RABBITMQ_HOME_DIR/bin/$1"; }

# rabbitmq_ctl ARGS...: rabbitmqctl against the node started by start_rabbitmq.
rabbitmq_ctl() {
    env "${SPW_RABBIT_ENV[@]}" "$(spw_rabbit_bin rabbitmqctl)" "$@"
}

spw_ensure_rabbitmq() {
    [ -x "$(spw_rabbit_bin rabbitmq-server)" ] && return 0
    spw_log "rabbitmq-server not installed: apt-get install -y rabbitmq-server"
    if [ "$(id -u)" = 0 ]; then
        DEBIAN_FRONTEND=noninteractive apt-get install -y rabbitmq-server >&2 ||
            { apt-get update >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y rabbitmq-server >&2; }
        # The package starts the system service on the default port: we don't want it.
        if command -v systemctl >/dev/null 2>&1; then systemctl stop rabbitmq-server 2>/dev/null || true; fi
    fi
    [ -x "$(spw_rabbit_bin rabbitmq-server)" ] || { spw_die "rabbitmq-server unavailable"; return 1; }
}

# start_rabbitmq: a private node (own name, epmd, ports, data, logs, cookie); sets
# BROKER_URL / RABBITMQ_URL / RABBITMQ_AMQP_ADDR.
start_rabbitmq() {
    spw_ensure_rabbitmq || return 1
    local dir port dist epmd_port node log pid epmd_pid deadline
    spw_workdir || return 1
    dir="$SPW_WORKDIR/rabbitmq"
    mkdir -p "$dir/home" "$dir/mnesia" "$dir/log"
    log="$dir/rabbitmq-server.log"
    node="spillway-bench-$$-$RANDOM@localhost"
    # Below the kernel's ephemeral range (32768 and up by default), so that no outgoing
    # connection (of a load generator, say) takes one of them between the check and the bind.
    for _ in $(seq 1 50); do
        port="$(free_port 10000 20000)" || return 1
        dist=$((port + 10000))
        port_is_free "$dist" && break
    done
    epmd_port="$(free_port 30000 32000)" || return 1
    printf '' >"$dir/rabbitmq-env.conf"
    # SPW_RABBIT_PLUGINS: enabled at boot from this file, offline (no rabbitmq-plugins call).
    local plugins="${SPW_RABBIT_PLUGINS:-}"
    echo "[${plugins// /,}]." >"$dir/enabled_plugins"
    cat >"$dir/rabbitmq.conf" <<EOF
listeners.tcp.default = 127.0.0.1:$port
loopback_users.guest = true
log.console = false
log.file.level = info
EOF
    # A fresh cookie for this node only; HOME points at it for the server and the CLI.
    head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$dir/home/.erlang.cookie"
    chmod 400 "$dir/home/.erlang.cookie"
    SPW_RABBIT_ENV=(
        HOME="$dir/home"
        ERL_EPMD_PORT="$epmd_port"
        RABBITMQ_NODENAME="$node"
        RABBITMQ_NODE_IP_ADDRESS=127.0.0.1
        RABBITMQ_NODE_PORT="$port"
        RABBITMQ_DIST_PORT="$dist"
        RABBITMQ_MNESIA_BASE="$dir/mnesia"
        RABBITMQ_LOG_BASE="$dir/log"
        RABBITMQ_PID_FILE="$dir/rabbitmq.pid"
        RABBITMQ_CONF_ENV_FILE="$dir/rabbitmq-env.conf"
        RABBITMQ_CONFIG_FILE="$dir/rabbitmq.conf"
        RABBITMQ_ADVANCED_CONFIG_FILE="$dir/advanced.config"
        RABBITMQ_ENABLED_PLUGINS_FILE="$dir/enabled_plugins"
        RABBITMQ_PLUGINS_EXPAND_DIR="$dir/plugins-expand"
        # A node that fails to start writes its crash dump here, not into the caller's
        # directory (the repository, when make bench runs it).
        ERL_CRASH_DUMP="$dir/erl_crash.dump"
    )
    # Our own epmd on its own port, so we never touch a shared one.
    spw_spawn "$dir/epmd.log" env "${SPW_RABBIT_ENV[@]}" epmd -port "$epmd_port"
    epmd_pid=$SPW_LAST_PID
    SPW_RABBIT_PGIDS+=("$epmd_pid")
    deadline=$((SECONDS + 10))
    until ! port_is_free "$epmd_port"; do
        spw_alive "$epmd_pid" || { spw_die "epmd failed (log: $dir/epmd.log)"; return 1; }
        [ "$SECONDS" -lt "$deadline" ] || { spw_die "epmd not listening on $epmd_port"; return 1; }
        sleep 0.1
    done
    spw_spawn "$log" env "${SPW_RABBIT_ENV[@]}" "$(spw_rabbit_bin rabbitmq-server)"
    pid=$SPW_LAST_PID
    SPW_RABBIT_PGIDS+=("$pid")
    spw_log "started rabbitmq-server $node (pid $pid, amqp 127.0.0.1:$port, log $log)"
    deadline=$((SECONDS + SPW_READY_TIMEOUT))
    # Poll the AMQP port, then confirm with await_startup.
    while port_is_free "$port"; do
        if ! spw_alive "$pid"; then
            tail -n 30 "$log" >&2; spw_die "rabbitmq-server exited during start (log: $log)"; return 1
        fi
        if [ "$SECONDS" -ge "$deadline" ]; then
            tail -n 30 "$log" >&2; spw_die "rabbitmq-server not listening after ${SPW_READY_TIMEOUT}s"; return 1
        fi
        sleep 0.2
    done
    rabbitmq_ctl -q await_startup --timeout "$SPW_READY_TIMEOUT" >>"$log" 2>&1 ||
        { spw_die "rabbitmqctl await_startup failed (log: $log)"; return 1; }
    RABBITMQ_AMQP_ADDR="127.0.0.1:$port"
    RABBITMQ_URL="amqp://guest:guest@$RABBITMQ_AMQP_ADDR/%2f"
    export RABBITMQ_AMQP_ADDR RABBITMQ_URL
    BROKER_URL="$RABBITMQ_URL"; export BROKER_URL
    spw_log "rabbitmq ready: amqp $RABBITMQ_AMQP_ADDR"
}

# start_rabbitmq_cluster: SPW_RABBIT_CLUSTER_SIZE (3) private RabbitMQ nodes on this host
# with one cookie and one epmd of their own, clustered with join_cluster (for quorum queues,
# RabbitMQ's replicated queue type). Sets BROKER_URL / RABBITMQ_URL / RABBITMQ_AMQP_ADDR to
# the first node; stop_rabbitmq stops them all.
start_rabbitmq_cluster() {
    spw_ensure_rabbitmq || return 1
    local size="${SPW_RABBIT_CLUSTER_SIZE:-3}" dir epmd_port epmd_pid deadline i port dist
    local node first="" ports=() nodes=() log pid
    spw_workdir || return 1
    dir="$SPW_WORKDIR/rabbitmq-cluster"
    mkdir -p "$dir/home"
    head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$dir/home/.erlang.cookie"
    chmod 400 "$dir/home/.erlang.cookie"
    epmd_port="$(free_port 30000 32000)" || return 1
    spw_spawn "$dir/epmd.log" env HOME="$dir/home" ERL_EPMD_PORT="$epmd_port" epmd -port "$epmd_port"
    epmd_pid=$SPW_LAST_PID
    SPW_RABBIT_PGIDS+=("$epmd_pid")
    deadline=$((SECONDS + 10))
    until ! port_is_free "$epmd_port"; do
        spw_alive "$epmd_pid" || { spw_die "epmd failed (log: $dir/epmd.log)"; return 1; }
        [ "$SECONDS" -lt "$deadline" ] || { spw_die "epmd not listening on $epmd_port"; return 1; }
        sleep 0.1
    done
    for i in $(seq 1 "$size"); do
        for _ in $(seq 1 50); do
            port="$(free_port 10000 20000)" || return 1
            dist=$((port + 10000))
            case " ${ports[*]} " in *" $port "*) continue ;; esac
            port_is_free "$dist" && break
        done
        ports+=("$port")
        node="spillway-bench-$$-$RANDOM-$i@localhost"
        nodes+=("$node")
        mkdir -p "$dir/$i/mnesia" "$dir/$i/log"
        printf '' >"$dir/$i/rabbitmq-env.conf"
        echo '[].' >"$dir/$i/enabled_plugins"
        printf '%s\n' "listeners.tcp.default = 127.0.0.1:$port" "loopback_users.guest = true" \
            "log.console = false" "log.file.level = info" >"$dir/$i/rabbitmq.conf"
        log="$dir/$i/rabbitmq-server.log"
        spw_spawn "$log" env HOME="$dir/home" ERL_EPMD_PORT="$epmd_port" \
            RABBITMQ_NODENAME="$node" RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 \
            RABBITMQ_NODE_PORT="$port" RABBITMQ_DIST_PORT="$dist" \
            RABBITMQ_MNESIA_BASE="$dir/$i/mnesia" RABBITMQ_LOG_BASE="$dir/$i/log" \
            RABBITMQ_PID_FILE="$dir/$i/rabbitmq.pid" RABBITMQ_CONF_ENV_FILE="$dir/$i/rabbitmq-env.conf" \
            RABBITMQ_CONFIG_FILE="$dir/$i/rabbitmq.conf" RABBITMQ_ADVANCED_CONFIG_FILE="$dir/$i/advanced.config" \
            RABBITMQ_ENABLED_PLUGINS_FILE="$dir/$i/enabled_plugins" \
            RABBITMQ_PLUGINS_EXPAND_DIR="$dir/$i/plugins-expand" ERL_CRASH_DUMP="$dir/$i/erl_crash.dump" \
            "$(spw_rabbit_bin rabbitmq-server)"
        pid=$SPW_LAST_PID
        SPW_RABBIT_PGIDS+=("$pid")
        spw_log "started rabbitmq-server $node (pid $pid, amqp 127.0.0.1:$port, log $log)"
    done
    # The CLI reaches every node through the shared cookie and epmd, once the node listens
    # (await_startup gives up on a node epmd does not know yet).
    SPW_RABBIT_ENV=(HOME="$dir/home" ERL_EPMD_PORT="$epmd_port" RABBITMQ_NODENAME="${nodes[0]}")
    deadline=$((SECONDS + SPW_READY_TIMEOUT))
    for port in "${ports[@]}"; do
        while port_is_free "$port"; do
            [ "$SECONDS" -lt "$deadline" ] ||
                { spw_die "rabbitmq not listening on $port after ${SPW_READY_TIMEOUT}s (logs: $dir)"; return 1; }
            sleep 0.2
        done
    done
    for node in "${nodes[@]}"; do
        rabbitmq_ctl -q -n "$node" await_startup --timeout "$SPW_READY_TIMEOUT" >>"$dir/cluster.log" 2>&1 ||
            { tail -n 30 "$dir/cluster.log" >&2; spw_die "rabbitmq node $node did not start (logs: $dir)"; return 1; }
    done
    first="${nodes[0]}"
    for node in "${nodes[@]:1}"; do
        { rabbitmq_ctl -q -n "$node" stop_app &&
            rabbitmq_ctl -q -n "$node" join_cluster "$first" &&
            rabbitmq_ctl -q -n "$node" start_app; } >>"$dir/cluster.log" 2>&1 ||
            { tail -n 30 "$dir/cluster.log" >&2; spw_die "rabbitmq node $node did not join $first"; return 1; }
    done
    rabbitmq_ctl -q -n "$first" cluster_status >>"$dir/cluster.log" 2>&1
    RABBITMQ_AMQP_ADDR="127.0.0.1:${ports[0]}"
    RABBITMQ_URL="amqp://guest:guest@$RABBITMQ_AMQP_ADDR/%2f"
    export RABBITMQ_AMQP_ADDR RABBITMQ_URL
    BROKER_URL="$RABBITMQ_URL"; export BROKER_URL
    spw_log "rabbitmq cluster of $size ready: amqp $RABBITMQ_AMQP_ADDR (nodes ${nodes[*]})"
}

stop_rabbitmq() {
    [ "${#SPW_RABBIT_PGIDS[@]}" -gt 0 ] || return 0
    local server="${SPW_RABBIT_PGIDS[${#SPW_RABBIT_PGIDS[@]}-1]}" pg
    if spw_alive "$server"; then
        timeout 60 env "${SPW_RABBIT_ENV[@]}" "$(spw_rabbit_bin rabbitmqctl)" -q stop \
            >/dev/null 2>&1 || spw_log "rabbitmqctl stop failed; killing the node"
    fi
    # Whatever is left of the node (beam.smp, erl_child_setup, inet_gethost) and our epmd.
    for pg in "${SPW_RABBIT_PGIDS[@]}"; do
        spw_kill_group "$pg" 10
    done
    SPW_RABBIT_PGIDS=()
}

# stop_all: stop everything this library started and remove its temp dir.
stop_all() {
    stop_spillway
    stop_rabbitmq
    if [ "${SPW_WORKDIR_OWNED:-0}" = 1 ] && [ -n "${SPW_WORKDIR:-}" ] && [ "${SPW_KEEP_WORKDIR:-0}" != 1 ]; then
        rm -rf "$SPW_WORKDIR"
        SPW_WORKDIR=""
        SPW_WORKDIR_OWNED=0
    fi
}
