#!/usr/bin/env bash
# Side-by-side throughput/latency benchmark (`make bench`):
#   Spillway all-in-one  |  Spillway as separate processes (storage, engine, gateway)  |  RabbitMQ
# Each target runs the same spillway-loadgen scenarios, through the same client
# (BENCH_CLIENT, `raw` by default: a lean client that costs the load generator about
# 1 µs per message; lapin costs ~40 µs on this kind of VM and would be what is measured):
#   transient     a. 1 KiB transient, auto-ack                       BENCH_COUNT messages
#   confirm-ack   b. as a + confirms (1000 in flight), manual ack, prefetch 100
#   persistent    c. 1 KiB persistent, durable queue, confirms, manual ack   BENCH_COUNT / 5
#   tx            t. as c, but in transactions: tx.commit every 100 publishes (each
#                    waited for) instead of confirms                      BENCH_COUNT / 5
#   large         e. 16 KiB transient, auto-ack                       BENCH_COUNT / 3
#   fixed-rate    f. 10,000 msg/s for BENCH_RATE_SECONDS (5), latency is the figure
#   fanout16      g. 16 producers / 16 consumers over 16 queues, auto-ack  BENCH_COUNT in all
#   amqp1-transient   a over AMQP 1.0 (loadgen --client amqp1, fe2o3-amqp, whatever BENCH_CLIENT
#                     says): pre-settled transfers, the receiver asks for settled deliveries
#                     (at-most-once, 1.0's auto-ack), link credit 1000      BENCH_COUNT
#   amqp1-persistent  c over AMQP 1.0: durable header, durable queue, unsettled transfers
#                     with up to 1000 outcomes outstanding (1.0's confirms: counted when
#                     `accepted`), each delivery settled with `accepted`, link credit 100
#                     (1.0's manual ack with prefetch 100)                  BENCH_PERSISTENT_COUNT
#                 Both on links to /amq/queue/Q (declared first over 0-9-1, as every case's
#                 queue), on the brokers' usual port: Spillway's gateway, and RabbitMQ with
#                 its rabbitmq_amqp1_0 plugin, which the script enables (SPW_RABBIT_PLUGINS,
#                 the node's enabled-plugins file) when one of these scenarios is selected.
#                 The 1.0 client costs more per message than raw (a write per frame).
#   compressible  i. 16 KiB compressible bodies (loadgen --body compressible), persistent,
#                    confirms: a backlog of BENCH_COUNT / 10 published with no consumer, its
#                    resident and disk bytes read, then drained. Spillway without compression
#                    (the spillway-* targets), with it (target spillway-compressed: all-in-one
#                    with gateway.message_compression_enabled, which runs only this case) and
#                    RabbitMQ (no compression); see docs/compression.md.
#   backlog       d. a backlog of BENCH_BACKLOG_BYTES (2 GiB) of 1 KiB transient messages,
#                    published with confirms into 2 durable queues with no consumer, then
#                    drained, with the flow-to-disk threshold (Spillway) and the memory
#                    watermark (RabbitMQ) at BENCH_BACKLOG_THRESHOLD (256 MiB): run by
#                    scripts/bench-flow-to-disk.sh (`make bench-flow-to-disk` runs it alone)
#                    through the same client, for spillway-all-in-one (with the loadgen's
#                    prefetch, then with none: --prefetch 0, then on priority queues: BENCH_BACKLOG_PRIORITIES)
#                    and rabbitmq (prefetch, priorities), in a table of its own
# For every other run the table shows msg/s,
# the max backlog (the most messages published and not yet consumed at once, sampled by the
# loadgen every 5 ms: whether the queue stays short), the broker's CPU per message (user + system time of every broker process, from /proc,
# over the messages published), end-to-end p50/p99, the broker's peak RSS during the run
# (sampled every 100 ms, summed over its processes) and lost messages. Every broker runs on
# free loopback ports in a temp dir and is stopped on exit (trap), also on failure or Ctrl-C.
#
# Environment:
#   BENCH_COUNT=300000            messages of the transient scenarios
#   BENCH_PERSISTENT_COUNT=...    persistent messages (default BENCH_COUNT / 5)
#   BENCH_SIZE=1024               message size in bytes (all but `large`)
#   BENCH_CLIENT=raw              loadgen client: raw or lapin
#   BENCH_RATE_SECONDS=5          length of the fixed-rate run
#   BENCH_IDLE=10000              queues and idle connections of case h
#   BENCH_TARGETS="spillway-all-in-one spillway-separate spillway-compressed spillway-group rabbitmq"
#                                 spillway-group: separate processes on a storage group of three
#                                 (docs/replication.md); runs cases c and t only, whose
#                                 confirms and commits wait for a majority's fsync;
#                                 rabbitmq-quorum: three RabbitMQ nodes clustered on this
#                                 machine, a quorum queue (x-queue-type=quorum), case c only
#   BENCH_SCENARIOS="transient confirm-ack persistent tx large fixed-rate fanout16 amqp1-transient amqp1-persistent compressible idle backlog delayed"
#                                 delayed: scripts/bench-delayed.sh (Spillway only, ~10 min;
#                                 BENCH_DELAYED_* there)
#   BENCH_BACKLOG_BYTES=2GiB      case d's backlog
#   BENCH_BACKLOG_THRESHOLD=256MiB  case d's flow-to-disk threshold and RabbitMQ watermark
#   BENCH_BACKLOG_PRIORITIES=10   case d again on priority queues with this many priorities
#                                 (loadgen --priorities; 0 = skip): RSS, drain rate, and
#                                 the drain's priority order (inversions) against RabbitMQ
#   BENCH_COMPRESSION_THRESHOLD=8KiB  gateway.message_compression_threshold_size of target
#                                 spillway-compressed (bodies longer than it are compressed)
#   BENCH_COMPRESSION_BODY=compressible  case i's bodies: compressible, or random (the cost
#                                 of trying to compress what does not shrink)
#   BENCH_LOADGEN_ARGS=""         extra loadgen arguments for every run
#   BENCH_SKIP_BUILD=1            use existing target/release binaries
#   BENCH_RESULTS=target/bench/results.jsonl   raw loadgen JSON, one line per run
#
# Exit status: 0 when every run happened (its figures are printed whatever they are, lost
# messages included); 1 when a build failed, a broker could not start or a run could not
# complete (loadgen error).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck source=lib/spillway-procs.sh
. "$ROOT/scripts/lib/spillway-procs.sh"

BENCH_COUNT="${BENCH_COUNT:-300000}"
BENCH_PERSISTENT_COUNT="${BENCH_PERSISTENT_COUNT:-$((BENCH_COUNT / 5 > 0 ? BENCH_COUNT / 5 : 1))}"
BENCH_SIZE="${BENCH_SIZE:-1024}"
BENCH_TARGETS="${BENCH_TARGETS:-spillway-all-in-one spillway-separate spillway-compressed spillway-group rabbitmq rabbitmq-quorum}"
BENCH_SCENARIOS="${BENCH_SCENARIOS:-transient confirm-ack persistent tx large fixed-rate fanout16 amqp1-transient amqp1-persistent compressible idle backlog delayed}"
BENCH_BACKLOG_BYTES="${BENCH_BACKLOG_BYTES:-2GiB}"
BENCH_BACKLOG_THRESHOLD="${BENCH_BACKLOG_THRESHOLD:-256MiB}"
BENCH_BACKLOG_PRIORITIES="${BENCH_BACKLOG_PRIORITIES:-10}"
BENCH_IDLE="${BENCH_IDLE:-10000}"
BENCH_CLIENT="${BENCH_CLIENT:-raw}"
BENCH_RATE_SECONDS="${BENCH_RATE_SECONDS:-5}"
BENCH_LOADGEN_ARGS="${BENCH_LOADGEN_ARGS:-}"
BENCH_COMPRESSION_BODY="${BENCH_COMPRESSION_BODY:-compressible}"
BENCH_RESULTS="${BENCH_RESULTS:-$ROOT/target/bench/results.jsonl}"
LOADGEN="${LOADGEN:-$ROOT/target/release/spillway-loadgen}"
export SPILLWAY_BIN="${SPILLWAY_BIN:-$ROOT/target/release/spillway}"
# The AMQP 1.0 cases need RabbitMQ's 1.0 plugin (on its 0-9-1 port), enabled at boot.
case " $BENCH_SCENARIOS " in
    *" amqp1-"*) export SPW_RABBIT_PLUGINS="${SPW_RABBIT_PLUGINS:+$SPW_RABBIT_PLUGINS }rabbitmq_amqp1_0" ;;
esac

LOADGEN_PID=""
cleanup() {
    if [ -n "$LOADGEN_PID" ]; then kill -TERM "$LOADGEN_PID" 2>/dev/null; wait "$LOADGEN_PID" 2>/dev/null; fi
    stop_all
}
trap cleanup EXIT
trap 'echo "[bench] interrupted" >&2; exit 130' INT TERM HUP

FAILED=0
ROWS=()
IDLE_ROWS=()
COMPRESSION_ROWS=()
BACKLOG_ROWS=()

log() { echo "[bench] $*" >&2; }

scenario_label() {
    local size="${BENCH_SIZE}B"
    [ "$BENCH_SIZE" = 1024 ] && size=1KiB
    case "$1" in
        transient) echo "a. $size transient" ;;
        confirm-ack) echo "b. $size confirm+ack" ;;
        persistent) echo "c. $size persistent" ;;
        tx) echo "t. $size tx, commit/100" ;;
        large) echo "e. 16KiB transient" ;;
        fixed-rate) echo "f. 10k msg/s" ;;
        fanout16) echo "g. 16x16 queues" ;;
        compressible) echo "i. 16KiB compressible" ;;
        amqp1-transient) echo "a. $size transient, 1.0" ;;
        amqp1-persistent) echo "c. $size persistent, 1.0" ;;
        *) echo "$1" ;;
    esac
}

# broker_pids: every process of the broker under test (the process groups we started).
broker_pids() {
    local g
    for g in "${SPW_SPILLWAY_PGIDS[@]}" "${SPW_RABBIT_PGIDS[@]}"; do
        [ -n "$g" ] && pgrep -g "$g"
    done
}

# broker_ticks: user + system clock ticks used so far by the broker's processes.
broker_ticks() {
    local pid total=0 t
    for pid in $(broker_pids); do
        t="$(awk '{print $14 + $15}' "/proc/$pid/stat" 2>/dev/null)" || continue
        total=$((total + ${t:-0}))
    done
    echo "$total"
}

# sample_rss FILE: until killed, writes the highest summed VmRSS (KiB) seen to FILE.
sample_rss() {
    local file="$1" peak=0 now pid
    while :; do
        now=0
        for pid in $(broker_pids); do
            now=$((now + $(awk '/^VmRSS/ {print $2}' "/proc/$pid/status" 2>/dev/null || echo 0)))
        done
        if [ "$now" -gt "$peak" ]; then
            peak=$now
            echo "$peak" >"$file.new" && mv "$file.new" "$file"
        fi
        sleep 0.1
    done
}

# ----------------------------------------------------------------------------- build
if [ "${BENCH_SKIP_BUILD:-0}" != 1 ]; then
    pkgs=(-p spillway-loadgen)
    case " $BENCH_TARGETS " in *" spillway-"*) pkgs=(-p spillway "${pkgs[@]}") ;; esac
    # scripts/cargo.sh adds the sccache compiler cache when it works; plain cargo otherwise.
    cargo_cmd=(cargo)
    [ -x "$ROOT/scripts/cargo.sh" ] && cargo_cmd=("$ROOT/scripts/cargo.sh")
    log "cargo build --release ${pkgs[*]}"
    if ! "${cargo_cmd[@]}" build --release "${pkgs[@]}"; then
        log "build failed"
        exit 1
    fi
fi
[ -x "$LOADGEN" ] || { log "missing $LOADGEN"; exit 1; }

mkdir -p "$(dirname "$BENCH_RESULTS")"
: >"$BENCH_RESULTS"
spw_workdir || exit 1

# --------------------------------------------------------------------------- running
# run_scenario TARGET SCENARIO: one loadgen run against $BROKER_URL; appends a table row.
run_scenario() {
    local target="$1" scenario="$2" args out rc
    local size="$BENCH_SIZE" pc=1 client="$BENCH_CLIENT"
    case "$scenario" in
        transient)
            args=(--count "$BENCH_COUNT" --auto-ack --queue bench-transient) ;;
        confirm-ack)
            args=(--count "$BENCH_COUNT" --confirm --confirm-window 1000 --prefetch 100 --queue bench-confirm) ;;
        persistent)
            args=(--count "$BENCH_PERSISTENT_COUNT" --persistent --confirm --confirm-window 1000 --prefetch 100 --queue bench-persistent) ;;
        tx)
            args=(--count "$BENCH_PERSISTENT_COUNT" --persistent --tx-every 100 --prefetch 100 --queue bench-tx) ;;
        large)
            size=16384
            args=(--count "$((BENCH_COUNT / 3))" --auto-ack --queue bench-large) ;;
        fixed-rate)
            args=(--count "$((10000 * BENCH_RATE_SECONDS))" --rate 10000 --prefetch 100 --queue bench-rate) ;;
        fanout16)
            pc=16
            args=(--count "$((BENCH_COUNT / 16))" --queues 16 --auto-ack --queue bench-fanout) ;;
        amqp1-transient)
            client=amqp1
            args=(--count "$BENCH_COUNT" --auto-ack --prefetch 1000 --queue bench-amqp1-transient) ;;
        amqp1-persistent)
            client=amqp1
            args=(--count "$BENCH_PERSISTENT_COUNT" --persistent --confirm --confirm-window 1000 --prefetch 100 --queue bench-amqp1-persistent) ;;
        *) log "unknown scenario $scenario"; FAILED=1; return ;;
    esac
    # RabbitMQ's replicated queue: a quorum queue on the three-node cluster.
    [ "$target" = rabbitmq-quorum ] && args+=(--queue-arg x-queue-type=quorum)
    # shellcheck disable=SC2206
    args+=(--url "$BROKER_URL" --client "$client" --producers "$pc" --consumers "$pc" --size "$size" --timeout 120 $BENCH_LOADGEN_ARGS)
    local ticks_before rss_file="$SPW_WORKDIR/rss.peak" sampler
    echo 0 >"$rss_file"
    sample_rss "$rss_file" &
    sampler=$!
    ticks_before="$(broker_ticks)"
    log "$target / $scenario: spillway-loadgen ${args[*]}"
    # In the background + wait, so that a signal to this script is handled at once.
    timeout 900 "$LOADGEN" "${args[@]}" >"$SPW_WORKDIR/loadgen.out" &
    LOADGEN_PID=$!
    wait "$LOADGEN_PID"
    rc=$?
    LOADGEN_PID=""
    local ticks=$(($(broker_ticks) - ticks_before))
    kill "$sampler" 2>/dev/null
    wait "$sampler" 2>/dev/null
    local rss_kib
    rss_kib="$(cat "$rss_file" 2>/dev/null)"
    local rss_mib=$((${rss_kib:-0} / 1024))
    out="$(grep '^{' "$SPW_WORKDIR/loadgen.out" | tail -n 1)"
    if [ -n "$out" ]; then
        printf '{"target":"%s","scenario":"%s","exit":%d,"result":%s}\n' \
            "$target" "$scenario" "$rc" "$out" >>"$BENCH_RESULTS"
    fi
    local label
    label="$(scenario_label "$scenario")"
    if [ -z "$out" ] || [ "$rc" -ge 2 ] || ! printf '%s' "$out" | grep -q '"errors":\[\]'; then
        log "$target / $scenario: run failed (exit $rc): $out"
        ROWS+=("$target|$label|FAILED|-|-|-|-|-|-|-")
        FAILED=1
        return
    fi
    [ "$rc" -eq 0 ] || log "$target / $scenario: verification failed: $out"
    local published cpu_us
    published="$(json_get "$out" published)"
    cpu_us="$(awk -v t="$ticks" -v hz="$(getconf CLK_TCK)" -v n="${published:-0}" \
        'BEGIN { if (n > 0) printf "%.1f", t * 1e6 / hz / n; else print "-" }')"
    ROWS+=("$target|$label|$(json_get "$out" publish_rate)|$(json_get "$out" consume_rate)|$(json_get "$out" max_backlog)|$cpu_us|$(json_get "$out" latency_p50_ms)|$(json_get "$out" latency_p99_ms)|$rss_mib|$(json_get "$out" lost)")
}

# resident_bytes TARGET: message bytes the broker holds in memory now: Spillway's
# spillway_broker_resident_message_bytes (summed over its processes' /metrics), RabbitMQ's
# message_bytes_ram of the queues.
resident_bytes() {
    local ready metrics total=0 value
    if [ "$1" = rabbitmq ]; then
        rabbitmq_ctl -q list_queues message_bytes_ram 2>/dev/null |
            awk '$1 ~ /^[0-9]+$/ { s += $1 } END { print s + 0 }'
        return
    fi
    for ready in "$SPW_WORKDIR"/*/ready.json; do
        metrics="$(json_get "$ready" metrics)"
        [ -n "$metrics" ] || continue
        value="$(curl -s --max-time 5 "http://$metrics/metrics" 2>/dev/null |
            awk '$1 == "spillway_broker_resident_message_bytes" { printf "%d", $2 }')"
        total=$((total + ${value:-0}))
    done
    echo "$total"
}

# disk_bytes TARGET: bytes of the broker's data directory (Spillway's store, RabbitMQ's mnesia).
disk_bytes() {
    if [ "$1" = rabbitmq ]; then
        du -sb "$SPW_WORKDIR/rabbitmq/mnesia" 2>/dev/null | awk '{ print $1 }'
    else
        du -sbc "$SPW_WORKDIR"/*/data 2>/dev/null | awk '$2 == "total" { print $1 }'
    fi
}

# run_compressible TARGET: case i: a persistent backlog of 16 KiB compressible bodies
# published with no consumer, its resident and disk bytes, then the drain.
run_compressible() {
    local target="$1" count=$((BENCH_COUNT / 10)) rc out pub drain ticks_before ticks
    local rss_file="$SPW_WORKDIR/rss.peak" sampler resident disk
    local common=(--url "$BROKER_URL" --client "$BENCH_CLIENT" --size 16384 --body "$BENCH_COMPRESSION_BODY"
        --persistent --queue bench-compressible --timeout 300)
    echo 0 >"$rss_file"
    sample_rss "$rss_file" &
    sampler=$!
    ticks_before="$(broker_ticks)"
    log "$target / compressible: publishing $count messages with no consumer"
    # shellcheck disable=SC2206
    timeout 900 "$LOADGEN" "${common[@]}" --count "$count" --confirm --confirm-window 1000 \
        --no-consume $BENCH_LOADGEN_ARGS >"$SPW_WORKDIR/loadgen.out" &
    LOADGEN_PID=$!
    wait "$LOADGEN_PID"
    rc=$?
    LOADGEN_PID=""
    pub="$(grep '^{' "$SPW_WORKDIR/loadgen.out" | tail -n 1)"
    resident="$(resident_bytes "$target")"
    disk="$(disk_bytes "$target")"
    log "$target / compressible: resident $resident B, disk $disk B; draining"
    if [ -n "$pub" ] && [ "$rc" -lt 2 ]; then
        # shellcheck disable=SC2206
        timeout 900 "$LOADGEN" "${common[@]}" --count "$count" --consume-only --prefetch 100 \
            $BENCH_LOADGEN_ARGS >"$SPW_WORKDIR/loadgen.out" &
        LOADGEN_PID=$!
        wait "$LOADGEN_PID"
        rc=$?
        LOADGEN_PID=""
        drain="$(grep '^{' "$SPW_WORKDIR/loadgen.out" | tail -n 1)"
    fi
    ticks=$(($(broker_ticks) - ticks_before))
    kill "$sampler" 2>/dev/null
    wait "$sampler" 2>/dev/null
    local rss_kib
    rss_kib="$(cat "$rss_file" 2>/dev/null)"
    for out in "$pub" "${drain:-}"; do
        [ -n "$out" ] && printf '{"target":"%s","scenario":"compressible","resident_bytes":%s,"disk_bytes":%s,"result":%s}\n' \
            "$target" "${resident:-0}" "${disk:-0}" "$out" >>"$BENCH_RESULTS"
    done
    if [ -z "$pub" ] || [ -z "${drain:-}" ] || [ "$rc" -ge 2 ] ||
        ! printf '%s' "$pub$drain" | grep -q '"errors":\[\]'; then
        log "$target / compressible: run failed (exit $rc): $pub $drain"
        COMPRESSION_ROWS+=("$target|FAILED|-|-|-|-|-|-")
        FAILED=1
        return
    fi
    local cpu_us
    cpu_us="$(awk -v t="$ticks" -v hz="$(getconf CLK_TCK)" -v n="$count" \
        'BEGIN { if (n > 0) printf "%.1f", t * 1e6 / hz / n; else print "-" }')"
    COMPRESSION_ROWS+=("$target|$(json_get "$pub" publish_rate)|$(json_get "$drain" consume_rate)|$cpu_us|$(awk -v b="${resident:-0}" 'BEGIN { printf "%.1f", b / 1048576 }')|$(awk -v b="${disk:-0}" 'BEGIN { printf "%.1f", b / 1048576 }')|$((${rss_kib:-0} / 1024))|$(json_get "$drain" lost)")
}

# broker_rss_kib: summed VmRSS of the broker's processes now.
broker_rss_kib() {
    local pid total=0
    for pid in $(broker_pids); do
        total=$((total + $(awk '/^VmRSS/ {print $2}' "/proc/$pid/status" 2>/dev/null || echo 0)))
    done
    echo "$total"
}

# run_idle TARGET: case h on the broker just started: RSS growth for BENCH_IDLE empty
# queues, then for BENCH_IDLE idle connections (held by the load generator until it is
# signalled); appends a row to IDLE_ROWS.
run_idle() {
    local target="$1" before after queue_kib conn_kib out="$SPW_WORKDIR/idle.out" deadline
    before="$(broker_rss_kib)"
    if ! "$LOADGEN" --url "$BROKER_URL" --declare-queues "$BENCH_IDLE" --queue bench-idle >"$out"; then
        log "$target / idle: declaring $BENCH_IDLE queues failed"
        IDLE_ROWS+=("$target|FAILED|-|-")
        FAILED=1
        return
    fi
    after="$(broker_rss_kib)"
    queue_kib="$(awk -v a="$after" -v b="$before" -v n="$BENCH_IDLE" 'BEGIN { printf "%.2f", (a - b) / n }')"
    : >"$out"
    before="$after"
    "$LOADGEN" --url "$BROKER_URL" --idle-connections "$BENCH_IDLE" --duration 600 >"$out" &
    LOADGEN_PID=$!
    deadline=$((SECONDS + 300))
    until grep -q idle_connections "$out" 2>/dev/null; do
        if ! kill -0 "$LOADGEN_PID" 2>/dev/null || [ "$SECONDS" -ge "$deadline" ]; then
            log "$target / idle: $BENCH_IDLE connections did not open"
            kill -TERM "$LOADGEN_PID" 2>/dev/null
            wait "$LOADGEN_PID" 2>/dev/null
            LOADGEN_PID=""
            IDLE_ROWS+=("$target|$queue_kib|FAILED|-")
            FAILED=1
            return
        fi
        sleep 0.2
    done
    after="$(broker_rss_kib)"
    kill -TERM "$LOADGEN_PID" 2>/dev/null
    wait "$LOADGEN_PID" 2>/dev/null
    LOADGEN_PID=""
    conn_kib="$(awk -v a="$after" -v b="$before" -v n="$BENCH_IDLE" 'BEGIN { printf "%.1f", (a - b) / n }')"
    IDLE_ROWS+=("$target|$queue_kib|$conn_kib|$((after / 1024))")
}

# bench_target TARGET START_FN STOP_FN
bench_target() {
    local target="$1" start="$2" stop="$3" s
    log "starting $target"
    if ! "$start"; then
        log "$target could not start"
        for s in $BENCH_SCENARIOS; do
            [ "$s" = idle ] || [ "$s" = backlog ] || [ "$s" = delayed ] || ROWS+=("$target|$(scenario_label "$s")|NOT STARTED|-|-|-|-|-|-")
        done
        FAILED=1
        "$stop"
        return
    fi
    local idle=0
    for s in $BENCH_SCENARIOS; do
        case "$s" in
            idle) [ "$target" = spillway-compressed ] || [ "$target" = spillway-group ] ||
                [ "$target" = rabbitmq-quorum ] || idle=1 ;;
            backlog | delayed) ;; # run_backlog and bench-delayed.sh, after every target
            compressible) [ "$target" = spillway-group ] || [ "$target" = rabbitmq-quorum ] ||
                run_compressible "$target" ;;
            # With compression on, only the case it is for; on a storage group, only
            # the cases whose confirms wait for its majority.
            persistent) [ "$target" = spillway-compressed ] || run_scenario "$target" "$s" ;;
            tx) [ "$target" = spillway-compressed ] || [ "$target" = rabbitmq-quorum ] ||
                run_scenario "$target" "$s" ;;
            *) [ "$target" = spillway-compressed ] || [ "$target" = spillway-group ] ||
                [ "$target" = rabbitmq-quorum ] || run_scenario "$target" "$s" ;;
        esac
    done
    log "stopping $target"
    "$stop"
    [ "$idle" = 1 ] || return
    # Case h on a fresh broker: memory freed by the runs above would be reused and hide
    # what queues and connections cost.
    log "starting $target again for the idle case"
    if ! "$start"; then
        IDLE_ROWS+=("$target|NOT STARTED|-|-")
        FAILED=1
        "$stop"
        return
    fi
    run_idle "$target"
    "$stop"
}

# start_spillway_compressed: all-in-one with message compression on. The threshold is
# BENCH_COMPRESSION_THRESHOLD (8KiB): bodies *longer* than it are compressed, so the default
# 16 KiB would leave the case's 16 KiB bodies alone.
start_spillway_compressed() {
    SPILLWAY_GATEWAY__MESSAGE_COMPRESSION_ENABLED=true \
        SPILLWAY_GATEWAY__MESSAGE_COMPRESSION_THRESHOLD_SIZE="${BENCH_COMPRESSION_THRESHOLD:-8KiB}" \
        start_spillway_all_in_one
}

# spill_completed RESULTS: the Spillway run of a bench-flow-to-disk results file completed.
spill_completed() {
    [ -f "$1" ] && [ "$(jq -s '[.[] | select(.kind == "run" and .target == "spill")] |
        (length > 0 and all(.ok))' "$1" 2>/dev/null)" = true ]
}

# run_backlog: case d, through scripts/bench-flow-to-disk.sh (a fresh broker per run, its own
# temp dir and traps): Spillway all-in-one with the loadgen's prefetch and RabbitMQ, then
# Spillway with no prefetch (the consumers take every delivery the broker sends unacked).
# Appends a row per run to BACKLOG_ROWS.
run_backlog() {
    local ftd_targets="" pass targets extra results line
    case " $BENCH_TARGETS " in *" spillway-all-in-one "*) ftd_targets=spill ;; esac
    case " $BENCH_TARGETS " in *" rabbitmq "*) ftd_targets="$ftd_targets rabbitmq" ;; esac
    [ -n "$ftd_targets" ] || { log "backlog: neither spillway-all-in-one nor rabbitmq is a target"; return; }
    for pass in prefetch no-prefetch priorities; do
        targets="$ftd_targets"; extra=""
        if [ "$pass" = no-prefetch ]; then
            case " $ftd_targets " in *" spill "*) targets=spill ;; *) continue ;; esac
            extra="--prefetch 0"
        fi
        if [ "$pass" = priorities ]; then
            # A priority queue (x-max-priority 9), priorities 0-9 spread over the backlog.
            extra="--priorities $BENCH_BACKLOG_PRIORITIES"
            [ "$BENCH_BACKLOG_PRIORITIES" -gt 0 ] || continue
        fi
        results="$SPW_WORKDIR/backlog-$pass.jsonl"
        log "backlog ($pass): scripts/bench-flow-to-disk.sh for $targets"
        if ! BENCH_SKIP_BUILD=1 BENCH_FTD_SIZES=1024 BENCH_FTD_TARGETS="$targets" \
            BENCH_FTD_BYTES="$BENCH_BACKLOG_BYTES" BENCH_FTD_THRESHOLD="$BENCH_BACKLOG_THRESHOLD" \
            BENCH_FTD_RABBITMQ_WATERMARK="$BENCH_BACKLOG_THRESHOLD" BENCH_FTD_RESULTS="$results" \
            BENCH_FTD_LOADGEN_ARGS="--client $BENCH_CLIENT $extra $BENCH_LOADGEN_ARGS" \
            "$ROOT/scripts/bench-flow-to-disk.sh" >"$SPW_WORKDIR/backlog-$pass.out"; then
            if [ "$pass" = priorities ] && spill_completed "$results"; then
                # RabbitMQ 3.10's priority queues do not page out enough to get under
                # the watermark: its publishers stay blocked and the run stalls. That
                # is a figure of this case, not a failure of the benchmark.
                log "backlog ($pass): RabbitMQ did not complete (publishers blocked for good)"
            else
                log "backlog ($pass): a run failed; its output:"
                cat "$SPW_WORKDIR/backlog-$pass.out" >&2
                FAILED=1
            fi
        fi
        [ -f "$results" ] || continue
        while IFS= read -r line; do
            BACKLOG_ROWS+=("$(jq -r --arg pass "$pass" '
                def f: if . == null then "-" else tostring end;
                def mib: if . == null then "-" else (. / 1048576 | floor | tostring) end;
                [(if .target == "spill" then "spillway-all-in-one" else .target end),
                 (if $pass == "prefetch" then "prefetch 100"
                  elif $pass == "priorities" then "prio, \(.loadgen_drain.priority_inversions // "?") inv."
                  else "no prefetch" end),
                 (.publish_msg_s | f), ((.loadgen_publish.blocked_ms // 0) / 1000 | floor | tostring),
                 (.drain_msg_s | f),
                 (if .broker_cpu_s == null then "-" else (.broker_cpu_s * 1e6 / .messages * 10 | floor / 10 | tostring) end),
                 (.peak_rss_publish_bytes | mib), (.peak_rss_drain_bytes | mib), (.lost | f),
                 (if .ok then ""
                  elif $pass == "priorities" and .target == "rabbitmq" then "stalled: publishers blocked"
                  else "FAILED" end)] | join("|")' <<<"$line")")
            cat >>"$BENCH_RESULTS" <<<"$line"
        done < <(grep '"kind":"run"' "$results")
    done
}

for target in $BENCH_TARGETS; do
    case "$target" in
        spillway-all-in-one) bench_target "$target" start_spillway_all_in_one stop_spillway ;;
        spillway-separate) bench_target "$target" start_spillway_separate stop_spillway ;;
        spillway-compressed) bench_target "$target" start_spillway_compressed stop_spillway ;;
        spillway-group) bench_target "$target" start_spillway_group stop_spillway ;;
        rabbitmq) bench_target "$target" start_rabbitmq stop_rabbitmq ;;
        rabbitmq-quorum) bench_target "$target" start_rabbitmq_cluster stop_rabbitmq ;;
        *) log "unknown target $target"; FAILED=1 ;;
    esac
done

# ----------------------------------------------------------------------------- table
echo
printf 'spillway-loadgen --client %s, %s B messages unless said; %s transient, %s persistent\n' \
    "$BENCH_CLIENT" "$BENCH_SIZE" "$BENCH_COUNT" "$BENCH_PERSISTENT_COUNT"
case " $BENCH_SCENARIOS " in
    *" amqp1-"*) echo 'rows ending "1.0": AMQP 1.0 through spillway-loadgen --client amqp1 (fe2o3-amqp)' ;;
esac
fmt='%-20s | %-24s | %10s | %10s | %11s | %8s | %8s | %8s | %8s | %6s\n'
# shellcheck disable=SC2059
printf "$fmt" target scenario "publish/s" "consume/s" "max backlog" "CPU µs" "p50 ms" "p99 ms" "RSS MiB" lost
printf '%s\n' "---------------------+--------------------------+------------+------------+-------------+----------+----------+----------+----------+-------"
for row in "${ROWS[@]}"; do
    IFS='|' read -r t sc pr cr backlog cpu p50 p99 rss lost <<<"$row"
    # shellcheck disable=SC2059
    printf "$fmt" "$t" "$sc" "$pr" "$cr" "$backlog" "$cpu" "$p50" "$p99" "$rss" "$lost"
done
if [ "${#IDLE_ROWS[@]}" -gt 0 ]; then
    echo
    printf 'h. broker RSS growth for %s empty queues, then %s idle connections (one channel each)\n' "$BENCH_IDLE" "$BENCH_IDLE"
    ifmt='%-20s | %14s | %14s | %22s\n'
    # shellcheck disable=SC2059
    printf "$ifmt" target "KiB per queue" "KiB per conn" "RSS MiB with everything"
    printf '%s\n' "---------------------+----------------+----------------+------------------------"
    for row in "${IDLE_ROWS[@]}"; do
        IFS='|' read -r t q c total <<<"$row"
        # shellcheck disable=SC2059
        printf "$ifmt" "$t" "$q" "$c" "$total"
    done
fi
if [ "${#COMPRESSION_ROWS[@]}" -gt 0 ]; then
    echo
    printf 'i. %s persistent 16 KiB %s bodies: backlog published with confirms, then drained;\n' "$((BENCH_COUNT / 10))" "$BENCH_COMPRESSION_BODY"
    printf '   resident = message bytes in memory with the backlog (Spillway: spillway_broker_resident_message_bytes,\n'
    printf '   RabbitMQ: message_bytes_ram), disk = the data directory then; CPU over both phases\n'
    cfmt='%-20s | %10s | %10s | %8s | %12s | %10s | %8s | %6s\n'
    # shellcheck disable=SC2059
    printf "$cfmt" target "publish/s" "drain/s" "CPU µs" "resident MiB" "disk MiB" "RSS MiB" lost
    printf '%s\n' "---------------------+------------+------------+----------+--------------+------------+----------+-------"
    for row in "${COMPRESSION_ROWS[@]}"; do
        IFS='|' read -r t pr cr cpu res disk rss lost <<<"$row"
        # shellcheck disable=SC2059
        printf "$cfmt" "$t" "$pr" "$cr" "$cpu" "$res" "$disk" "$rss" "$lost"
    done
fi
case " $BENCH_SCENARIOS " in *" backlog "*) run_backlog ;; esac
if [ "${#BACKLOG_ROWS[@]}" -gt 0 ]; then
    echo
    printf 'd. a %s backlog of 1 KiB transient messages into 2 durable queues, threshold (RabbitMQ: watermark) %s:\n' "$BENCH_BACKLOG_BYTES" "$BENCH_BACKLOG_THRESHOLD"
    printf '   filled with confirms and no consumer, then drained; blocked = seconds publishers were held by\n'
    printf '   connection.blocked, CPU over fill and drain, RSS = peak of the broker process in each phase;\n'
    printf '   "prio, N inv.": priority queues (x-max-priority %s), priorities spread over the backlog,\n' "$((BENCH_BACKLOG_PRIORITIES - 1))"
    printf '   prefetch 100; N = deliveries of a higher priority than the one before (0: drained in order)\n'
    dfmt='%-20s | %-13s | %10s | %9s | %10s | %8s | %12s | %13s | %6s %s\n'
    # shellcheck disable=SC2059
    printf "$dfmt" target consumer "fill/s" "blocked s" "drain/s" "CPU µs" "RSS fill MiB" "RSS drain MiB" lost ""
    printf '%s\n' "---------------------+---------------+------------+-----------+------------+----------+--------------+---------------+-------"
    for row in "${BACKLOG_ROWS[@]}"; do
        IFS='|' read -r t c pr blocked dr cpu rf rd lost failed <<<"$row"
        # shellcheck disable=SC2059
        printf "$dfmt" "$t" "$c" "$pr" "$blocked" "$dr" "$cpu" "$rf" "$rd" "$lost" "$failed"
    done
fi
case " $BENCH_SCENARIOS " in
    *" delayed "*)
        # Delayed messages (scripts/bench-delayed.sh, Spillway only: Debian's RabbitMQ has no
        # delayed-message plugin): 10 million of 100 bytes due over 10 minutes.
        echo
        echo "delayed messages (x-delayed-message), Spillway all-in-one:"
        BENCH_SKIP_BUILD=1 scripts/bench-delayed.sh || FAILED=1
        ;;
esac
echo "raw results: $BENCH_RESULTS"
exit "$FAILED"
