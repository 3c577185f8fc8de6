#!/usr/bin/env bash
# Delayed messages (x-delayed-message exchanges, docs/compatibility.md): many small
# persistent messages, due evenly over a window, through Spillway all-in-one with a memory
# budget; prints how late they were routed and what the broker's memory did.
#
#   BENCH_DELAYED_MESSAGES=10000000   messages
#   BENCH_DELAYED_SIZE=100            bytes each
#   BENCH_DELAYED_SPREAD_SECS=600     due times spread over this window
#   BENCH_DELAYED_THRESHOLD=256MiB    engine.flow_to_disk_threshold (the memory budget)
#   BENCH_SKIP_BUILD=1                use the binaries already built
#
# Figures: publish rate, lateness (arrival minus due time) p50/p99/p99.9/max, early
# arrivals (must be 0), lost (must be 0), the broker's peak RSS (VmHWM) against the
# budget + 128 MiB, the store's size. RabbitMQ is not measured: Debian's rabbitmq-server
# ships without the community delayed-message plugin.
set -euo pipefail
cd "$(dirname "$0")/.."

to_bytes() {
    local v="$1"
    case "$v" in
        *GiB) echo $(( ${v%GiB} * 1024 * 1024 * 1024 )) ;;
        *MiB) echo $(( ${v%MiB} * 1024 * 1024 )) ;;
        *KiB) echo $(( ${v%KiB} * 1024 )) ;;
        *) echo "$v" ;;
    esac
}
mib() { echo $(( $1 / 1024 / 1024 )); }

MESSAGES="${BENCH_DELAYED_MESSAGES:-10000000}"
SIZE="${BENCH_DELAYED_SIZE:-100}"
SPREAD="${BENCH_DELAYED_SPREAD_SECS:-600}"
THRESHOLD="$(to_bytes "${BENCH_DELAYED_THRESHOLD:-256MiB}")"
RSS_SLACK=$((128 * 1024 * 1024))

if [ "${BENCH_SKIP_BUILD:-0}" != 1 ]; then
    scripts/cargo.sh build --release -p spillway -p spillway-loadgen
fi
BENCH_BIN="${CARGO_TARGET_DIR:-target}/release/spillway-delayed-bench"

# shellcheck source=lib/spillway-procs.sh
. scripts/lib/spillway-procs.sh
trap stop_all EXIT

SPILLWAY_ENGINE__FLOW_TO_DISK_THRESHOLD="$THRESHOLD" start_spillway_all_in_one
pid="${SPW_SPILLWAY_PGIDS[${#SPW_SPILLWAY_PGIDS[@]}-1]}"
data_dir="$SPW_WORKDIR/all-in-one/data"
echo "bench-delayed: $MESSAGES messages of $SIZE B due over ${SPREAD}s, budget $(mib "$THRESHOLD") MiB (spillway pid $pid)"

# The store's peak size, sampled while the messages wait.
peak_store=0
(
    while kill -0 "$pid" 2>/dev/null; do
        du -sb "$data_dir" 2>/dev/null | awk '{print $1}'
        sleep 5
    done
) > "$SPW_WORKDIR/store-sizes.txt" &
sampler=$!

start=$(date +%s)
result="$("$BENCH_BIN" --url "$BROKER_URL" --messages "$MESSAGES" --size "$SIZE" --spread-secs "$SPREAD")"
wall=$(( $(date +%s) - start ))
hwm_kib="$(awk '/^VmHWM:/ {print $2}' "/proc/$pid/status")"
cpu_ticks="$(awk '{print $14 + $15}' "/proc/$pid/stat")"
kill "$sampler" 2>/dev/null || true
wait "$sampler" 2>/dev/null || true
peak_store="$(sort -n "$SPW_WORKDIR/store-sizes.txt" | tail -1)"
rss=$((hwm_kib * 1024))
ticks_per_sec="$(getconf CLK_TCK)"
cpu_us_per_msg="$(awk -v t="$cpu_ticks" -v hz="$ticks_per_sec" -v n="$MESSAGES" 'BEGIN { printf "%.1f", t / hz * 1e6 / n }')"

field() { python3 -c 'import json,sys; print(json.loads(sys.argv[1])[sys.argv[2]])' "$result" "$1"; }
lost="$(field lost)"; early="$(field early)"; p99="$(field lateness_ms_p99)"
echo "bench-delayed: $result"
printf '  publish      %.0f msg/s (%.0f s)\n' "$(field publish_rate)" "$(field publish_secs)"
printf '  lateness     p50 %s ms, p99 %s ms, p99.9 %s ms, max %s ms\n' \
    "$(field lateness_ms_p50)" "$p99" "$(field lateness_ms_p999)" "$(field lateness_ms_max)"
printf '  received     %s, lost %s, duplicates %s, early %s\n' "$(field received)" "$lost" "$(field duplicates)" "$early"
printf '  broker       peak RSS %s MiB (budget %s MiB + 128), CPU %s us/msg, store peak %s MiB, wall %s s\n' \
    "$(mib "$rss")" "$(mib "$THRESHOLD")" "$cpu_us_per_msg" "$(mib "${peak_store:-0}")" "$wall"

ok=1
promise() { if [ "$2" = 1 ]; then echo "  promise ok:     $1"; else echo "  promise FAILED: $1"; ok=0; fi; }
promise "lost $lost = 0" "$([ "$lost" = 0 ] && echo 1 || echo 0)"
promise "early $early = 0" "$([ "$early" = 0 ] && echo 1 || echo 0)"
promise "peak RSS $(mib "$rss") MiB <= budget + 128 MiB" "$([ "$rss" -le $((THRESHOLD + RSS_SLACK)) ] && echo 1 || echo 0)"
promise "lateness p99 $p99 ms <= 100 ms" "$([ "$p99" -le 100 ] && echo 1 || echo 0)"
[ "$ok" = 1 ]
