#!/usr/bin/env bash
# Side-by-side throughput/latency benchmark (`make bench`):
#   Spillway all-in-one  |  Spillway as separate processes (storage, engine, gateway)  |  RabbitMQ
# Each target runs the same spillway-loadgen scenarios (1 producer, 1 consumer, 1 KiB):
#   transient             BENCH_COUNT messages (default 100000)
#   persistent+confirm    BENCH_PERSISTENT_COUNT messages (default BENCH_COUNT / 5)
# and the script prints a table. Every broker runs on free loopback ports in a temp dir and is
# stopped on exit (trap), also on failure or Ctrl-C.
#
# Environment:
#   BENCH_COUNT=100000            transient messages per run
#   BENCH_PERSISTENT_COUNT=...    persistent messages per run (default BENCH_COUNT / 5)
#   BENCH_SIZE=1024               message size in bytes
#   BENCH_TARGETS="spillway-all-in-one spillway-separate rabbitmq"
#   BENCH_SCENARIOS="transient persistent"
#   BENCH_LOADGEN_ARGS=""         extra loadgen arguments for every run (e.g. "--prefetch 500")
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

BENCH_COUNT="${BENCH_COUNT:-100000}"
BENCH_PERSISTENT_COUNT="${BENCH_PERSISTENT_COUNT:-$((BENCH_COUNT / 5 > 0 ? BENCH_COUNT / 5 : 1))}"
BENCH_SIZE="${BENCH_SIZE:-1024}"
BENCH_TARGETS="${BENCH_TARGETS:-spillway-all-in-one spillway-separate rabbitmq}"
BENCH_SCENARIOS="${BENCH_SCENARIOS:-transient persistent}"
BENCH_LOADGEN_ARGS="${BENCH_LOADGEN_ARGS:-}"
BENCH_RESULTS="${BENCH_RESULTS:-$ROOT/target/bench/results.jsonl}"
LOADGEN="$ROOT/target/release/spillway-loadgen"
export SPILLWAY_BIN="${SPILLWAY_BIN:-$ROOT/target/release/spillway}"

LOADGEN_PID=""
cleanup() {
    if [ -n "$LOADGEN_PID" ]; then kill -TERM "$LOADGEN_PID" 2>/dev/null; wait "$LOADGEN_PID" 2>/dev/null; fi
    stop_all
}
trap cleanup EXIT
trap 'echo "[bench] interrupted" >&2; exit 130' INT TERM HUP

FAILED=0
ROWS=()

log() { echo "[bench] $*" >&2; }

scenario_label() {
    local size="${BENCH_SIZE}B"
    [ "$BENCH_SIZE" = 1024 ] && size=1KiB
    case "$1" in
        persistent) echo "$size persistent+confirm" ;;
        *) echo "$size $1" ;;
    esac
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
    case "$scenario" in
        transient)
            args=(--count "$BENCH_COUNT" --queue bench-transient) ;;
        persistent)
            args=(--count "$BENCH_PERSISTENT_COUNT" --persistent --confirm --queue bench-persistent) ;;
        *) log "unknown scenario $scenario"; FAILED=1; return ;;
    esac
    # shellcheck disable=SC2206
    args+=(--url "$BROKER_URL" --producers 1 --consumers 1 --size "$BENCH_SIZE" --timeout 120 $BENCH_LOADGEN_ARGS)
    log "$target / $scenario: spillway-loadgen ${args[*]}"
    # In the background + wait, so that a signal to this script is handled at once.
    timeout 900 "$LOADGEN" "${args[@]}" >"$SPW_WORKDIR/loadgen.out" &
    LOADGEN_PID=$!
    wait "$LOADGEN_PID"
    rc=$?
    LOADGEN_PID=""
    out="$(grep '^{' "$SPW_WORKDIR/loadgen.out" | tail -n 1)"
    if [ -n "$out" ]; then
        printf '{"target":"%s","scenario":"%s","exit":%d,"result":%s}\n' \
            "$target" "$scenario" "$rc" "$out" >>"$BENCH_RESULTS"
    fi
    local label
    label="$(scenario_label "$scenario")"
    if [ -z "$out" ] || [ "$rc" -ge 2 ] || ! printf '%s' "$out" | grep -q '"errors":\[\]'; then
        log "$target / $scenario: run failed (exit $rc): $out"
        ROWS+=("$target|$label|FAILED|-|-|-|-")
        FAILED=1
        return
    fi
    [ "$rc" -eq 0 ] || log "$target / $scenario: verification failed: $out"
    ROWS+=("$target|$label|$(json_get "$out" publish_rate)|$(json_get "$out" consume_rate)|$(json_get "$out" latency_p50_ms)|$(json_get "$out" latency_p99_ms)|$(json_get "$out" lost)")
}

# bench_target TARGET START_FN STOP_FN
bench_target() {
    local target="$1" start="$2" stop="$3" s
    log "starting $target"
    if ! "$start"; then
        log "$target could not start"
        for s in $BENCH_SCENARIOS; do ROWS+=("$target|$(scenario_label "$s")|NOT STARTED|-|-|-|-"); done
        FAILED=1
        "$stop"
        return
    fi
    for s in $BENCH_SCENARIOS; do run_scenario "$target" "$s"; done
    log "stopping $target"
    "$stop"
}

for target in $BENCH_TARGETS; do
    case "$target" in
        spillway-all-in-one) bench_target "$target" start_spillway_all_in_one stop_spillway ;;
        spillway-separate) bench_target "$target" start_spillway_separate stop_spillway ;;
        rabbitmq) bench_target "$target" start_rabbitmq stop_rabbitmq ;;
        *) log "unknown target $target"; FAILED=1 ;;
    esac
done

# ----------------------------------------------------------------------------- table
echo
printf 'spillway-loadgen, 1 producer / 1 consumer, %s B messages: %s transient, %s persistent+confirm\n' \
    "$BENCH_SIZE" "$BENCH_COUNT" "$BENCH_PERSISTENT_COUNT"
fmt='%-20s | %-24s | %14s | %14s | %8s | %8s | %6s\n'
# shellcheck disable=SC2059
printf "$fmt" target scenario "publish msg/s" "consume msg/s" "p50 ms" "p99 ms" lost
printf '%s\n' "---------------------+--------------------------+----------------+----------------+----------+----------+-------"
for row in "${ROWS[@]}"; do
    IFS='|' read -r t sc pr cr p50 p99 lost <<<"$row"
    # shellcheck disable=SC2059
    printf "$fmt" "$t" "$sc" "$pr" "$cr" "$p50" "$p99" "$lost"
done
echo "raw results: $BENCH_RESULTS"
exit "$FAILED"
