#!/usr/bin/env bash
# Flow-to-disk benchmark (`make bench-flow-to-disk`): a backlog much larger than the
# message-memory budget is built with no consumer, then drained.
#
# For every message size in BENCH_FTD_SIZES and every target in BENCH_FTD_TARGETS:
#   1. start a fresh broker on free loopback ports in a temp dir;
#   2. publish BENCH_FTD_BYTES of transient messages (publisher confirms) into
#      BENCH_FTD_QUEUES durable queues, one producer per queue, no consumer
#      (spillway-loadgen --no-consume --durable --confirm);
#   3. drain it with one consumer per queue and verify every message came back once, in order
#      (spillway-loadgen --consume-only);
#   4. stop the broker.
# While it runs, a sampler reads the broker process's VmRSS (/proc/PID/status; for RabbitMQ
# the beam.smp process) and, for Spillway, spillway_broker_resident_message_bytes from
# /metrics every BENCH_FTD_SAMPLE_MS (200 ms).
#
# Targets:
#   spill      Spillway all-in-one, engine.flow_to_disk_threshold = BENCH_FTD_THRESHOLD (256 MiB)
#   memory     Spillway all-in-one, threshold BENCH_FTD_MEMORY_THRESHOLD (8 GiB, above the
#              backlog: everything stays in memory)
#   rabbitmq   Debian's rabbitmq-server, vm_memory_high_watermark.absolute =
#              BENCH_FTD_RABBITMQ_WATERMARK (256 MiB: the whole node's memory, an idle node
#              already takes about 100 MiB, so it is not lowered with the threshold), classic queues
#              with RabbitMQ's defaults (3.10: classic queue version 1, not lazy; transient
#              messages are paged to disk past vm_memory_high_watermark_paging_ratio = 0.5 of
#              the watermark, publishers are blocked at the watermark)
#
# Output: a table per run and a summary table, the flow-to-disk promises checked against the
# figures, and one JSON line per run appended to BENCH_FTD_RESULTS. The sampled series and the
# broker logs are kept under target/bench/flow-to-disk/.
#
# Environment (sizes are bytes or NUMBER{KiB,MiB,GiB}):
#   BENCH_FTD_BYTES=2GiB              backlog per run
#   BENCH_FTD_SIZES="1024 65536"      message body sizes
#   BENCH_FTD_TARGETS="spill memory rabbitmq"
#   BENCH_FTD_THRESHOLD=256MiB        spill threshold (and RabbitMQ's watermark by default)
#   BENCH_FTD_MEMORY_THRESHOLD=8GiB   "memory" threshold; must exceed the backlog
#   BENCH_FTD_RABBITMQ_WATERMARK=256MiB
#   BENCH_FTD_QUEUES=2                durable queues = producers = consumers
#   BENCH_FTD_SAMPLE_MS=200           sampling period
#   BENCH_FTD_TIMEOUT=1800            seconds each phase (publish, drain) may take
#   BENCH_FTD_STALL=120               a phase with no progress for this many seconds is
#                                     stopped and reported as stalled
#   BENCH_FTD_LOADGEN_ARGS=""         extra loadgen arguments for both phases
#   BENCH_FTD_RESULTS=target/bench/flow-to-disk.jsonl
#   BENCH_FTD_STRICT=1                exit 2 when a promise does not hold
#   BENCH_SKIP_BUILD=1                use the existing target/release binaries
#   SPW_KEEP_WORKDIR=1                keep the temp dir (data, logs)
#
# A quick run: BENCH_FTD_BYTES=256MiB BENCH_FTD_THRESHOLD=32MiB make bench-flow-to-disk
#
# Exit status: 0 when every run completed (whatever its figures); 1 when a build, a broker
# start or a run failed; 2 with BENCH_FTD_STRICT=1 when a promise does not hold.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck source=lib/spillway-procs.sh
. "$ROOT/scripts/lib/spillway-procs.sh"

log() { echo "[bench-ftd] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# to_bytes 256MiB -> 268435456
to_bytes() {
    local v="$1" n unit
    n="${v%%[!0-9]*}"
    unit="${v#"$n"}"
    [ -n "$n" ] || { echo "bad size: $v" >&2; return 1; }
    case "$unit" in
        "" | B) echo "$n" ;;
        KiB | K | k) echo $((n * 1024)) ;;
        MiB | M) echo $((n * 1024 * 1024)) ;;
        GiB | G) echo $((n * 1024 * 1024 * 1024)) ;;
        *) echo "bad size unit: $v" >&2; return 1 ;;
    esac
}

BENCH_FTD_BYTES="$(to_bytes "${BENCH_FTD_BYTES:-2GiB}")"
BENCH_FTD_SIZES="${BENCH_FTD_SIZES:-1024 65536}"
BENCH_FTD_TARGETS="${BENCH_FTD_TARGETS:-spill memory rabbitmq}"
THRESHOLD="$(to_bytes "${BENCH_FTD_THRESHOLD:-256MiB}")"
MEMORY_THRESHOLD="$(to_bytes "${BENCH_FTD_MEMORY_THRESHOLD:-8GiB}")"
WATERMARK="$(to_bytes "${BENCH_FTD_RABBITMQ_WATERMARK:-256MiB}")"
STALL="${BENCH_FTD_STALL:-120}"
QUEUES="${BENCH_FTD_QUEUES:-2}"
SAMPLE_MS="${BENCH_FTD_SAMPLE_MS:-200}"
PHASE_TIMEOUT="${BENCH_FTD_TIMEOUT:-1800}"
LOADGEN_ARGS="${BENCH_FTD_LOADGEN_ARGS:-}"
RESULTS="${BENCH_FTD_RESULTS:-$ROOT/target/bench/flow-to-disk.jsonl}"
KEEP_DIR="$ROOT/target/bench/flow-to-disk"
LOADGEN="$ROOT/target/release/spillway-loadgen"
export SPILLWAY_BIN="${SPILLWAY_BIN:-$ROOT/target/release/spillway}"
RSS_SLACK=$((128 * 1024 * 1024))
MiB=1048576

[ "$MEMORY_THRESHOLD" -gt "$BENCH_FTD_BYTES" ] ||
    log "warning: BENCH_FTD_MEMORY_THRESHOLD ($MEMORY_THRESHOLD) does not exceed the backlog ($BENCH_FTD_BYTES)"

LOADGEN_PID=""
SAMPLER_PID=""
stop_sampler() {
    if [ -n "$SAMPLER_PID" ]; then
        kill -TERM "$SAMPLER_PID" 2>/dev/null || true
        wait "$SAMPLER_PID" 2>/dev/null || true
        SAMPLER_PID=""
    fi
}
cleanup() {
    local rc=$?
    set +e
    if [ -n "$LOADGEN_PID" ]; then
        # timeout(1) runs in its own process group with the loadgen; a draining loadgen does
        # not stop on TERM, so KILL the group after a grace period.
        kill -TERM "$LOADGEN_PID" 2>/dev/null
        for _ in $(seq 1 50); do kill -0 "$LOADGEN_PID" 2>/dev/null || break; sleep 0.1; done
        kill -KILL -- "-$LOADGEN_PID" 2>/dev/null
        wait "$LOADGEN_PID" 2>/dev/null
    fi
    stop_sampler
    stop_all
    exit "$rc"
}
trap cleanup EXIT
trap 'log "interrupted"; exit 130' INT TERM HUP

# ----------------------------------------------------------------------------- build
if [ "${BENCH_SKIP_BUILD:-0}" != 1 ]; then
    log "scripts/cargo.sh build --release -p spillway -p spillway-loadgen"
    "$ROOT/scripts/cargo.sh" build --release -p spillway -p spillway-loadgen || die "build failed"
fi
[ -x "$LOADGEN" ] || die "missing $LOADGEN"
"$LOADGEN" --help | grep -q -- '--durable' || die "$LOADGEN lacks --durable: rebuild it"

mkdir -p "$(dirname "$RESULTS")" "$KEEP_DIR"
spw_workdir

# ----------------------------------------------------------------------------- helpers
now_ms() { date +%s%3N; }

# cpu_ticks PID -> utime+stime in clock ticks (0 when gone)
cpu_ticks() {
    local stat rest
    stat="$(cat "/proc/$1/stat" 2>/dev/null)" || { echo 0; return; }
    rest="${stat##*) }" # fields from 3 on
    # shellcheck disable=SC2086
    set -- $rest
    echo $((${12} + ${13}))
}

# system_cpu -> "busy total" jiffies from /proc/stat
system_cpu() {
    local _cpu user nice sys idle iowait irq softirq steal _rest
    read -r _cpu user nice sys idle iowait irq softirq steal _rest </proc/stat
    echo "$((user + nice + sys + irq + softirq + steal)) $((user + nice + sys + idle + iowait + irq + softirq + steal))"
}

# sampler PID METRICS_ADDR OUT: every SAMPLE_MS append "epoch_ms rss_bytes resident_bytes
# active bookkeeping_bytes heap_allocated heap_resident store_memory" to OUT (the metrics
# columns "-" without metrics), until killed or PID exits.
sampler() {
    local pid="$1" metrics="$2" out="$3" rss line resident active key value
    local bookkeeping allocated heap store
    local period
    period="$(awk -v ms="$SAMPLE_MS" 'BEGIN { printf "%.3f", ms / 1000 }')"
    trap 'exit 0' TERM
    while [ -r "/proc/$pid/status" ]; do
        rss=0
        while read -r key value _; do
            if [ "$key" = VmRSS: ]; then rss=$((value * 1024)); break; fi
        done <"/proc/$pid/status" 2>/dev/null || true
        resident=-; active=-; bookkeeping=-; allocated=-; heap=-; store=-
        if [ -n "$metrics" ]; then
            store=0
            while read -r key value; do
                case "$key" in
                    spillway_broker_resident_message_bytes) resident="${value%.*}" ;;
                    spillway_broker_flow_to_disk_active) active="${value%.*}" ;;
                    spillway_broker_bookkeeping_bytes) bookkeeping="${value%.*}" ;;
                    'spillway_allocator_bytes{kind="allocated"}') allocated="${value%.*}" ;;
                    'spillway_allocator_bytes{kind="resident"}') heap="${value%.*}" ;;
                    spillway_store_memory_bytes*) store=$((store + ${value%.*})) ;;
                esac
            done < <(curl -s --max-time 1 "http://$metrics/metrics" 2>/dev/null |
                grep -E '^spillway_(broker_(resident_message_bytes|flow_to_disk_active|bookkeeping_bytes)|allocator_bytes|store_memory_bytes)[ {]' || true)
        fi
        line="$(now_ms) $rss $resident $active $bookkeeping $allocated $heap $store"
        echo "$line" >>"$out"
        sleep "$period"
    done
}

# series_max FILE FROM_MS TO_MS COLUMN -> max of COLUMN over samples in [FROM, TO] ("n/a")
series_max() {
    awk -v a="$2" -v b="$3" -v c="$4" '
        $1 >= a && $1 <= b && $c != "-" { if (!seen || $c + 0 > m) m = $c + 0; seen = 1 }
        END { if (seen) printf "%.0f\n", m; else print "n/a" }' "$1"
}

# metric_sum ADDR NAME -> sum of every series of NAME on /metrics
metric_sum() {
    curl -s --max-time 5 "http://$1/metrics" 2>/dev/null |
        awk -v n="$2" '$1 == n || index($1, n "{") == 1 { s += $NF; seen = 1 } END { if (seen) printf "%.0f\n", s; else print "n/a" }'
}

mib() { # bytes -> MiB with one decimal, or n/a
    case "$1" in "" | n/a | -) echo n/a ;; *) awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }' ;; esac
}

# run_loadgen OUTFILE ARGS...: loadgen in the background (signals reach us at once); sets RC
# and STALLED. The loadgen prints progress every 5 s; when published + consumed has not moved
# for STALL seconds the run is stopped (SIGKILL: a draining loadgen ignores TERM).
run_loadgen() {
    local out="$1"; shift
    local last="" last_change=$SECONDS cur
    log "spillway-loadgen $*"
    timeout --signal=TERM --kill-after=30 "$((PHASE_TIMEOUT + 120))" "$LOADGEN" "$@" --progress 5 \
        >"$out" 2>"$out.err" &
    LOADGEN_PID=$!
    STALLED=no
    while kill -0 "$LOADGEN_PID" 2>/dev/null; do
        sleep 1
        cur="$(grep 'progress' "$out.err" 2>/dev/null | tail -n 1 |
            sed -n -E 's/.*published=([0-9]+) .*consumed=([0-9]+) .*/\1 \2/p' || true)"
        if [ "$cur" != "$last" ]; then
            last="$cur"; last_change=$SECONDS
        elif [ $((SECONDS - last_change)) -ge "$STALL" ]; then
            log "STALL: no progress for ${STALL}s (published consumed: $cur); stopping the loadgen"
            STALLED=yes
            kill -KILL -- "-$LOADGEN_PID" 2>/dev/null || true
            break
        fi
    done
    RC=0
    wait "$LOADGEN_PID" || RC=$?
    LOADGEN_PID=""
    [ "$STALLED" = no ] || RC=3
    grep -v progress "$out.err" | tail -n 5 >&2 || true
    grep progress "$out.err" | tail -n 1 >&2 || true
}

ROWS=()
FAILED=0
declare -A FIG # FIG[target/size/field]

# ----------------------------------------------------------------------------- one run
# bench_run TARGET SIZE
bench_run() {
    local target="$1" size="$2"
    local run="$target-$size" dir pid metrics="" label threshold_cfg="n/a" count total
    local t0 t1 t2 cpu0 cpu1 sys0 sys1 load0 load1 pub drain pubrc drainrc
    dir="$SPW_WORKDIR/run-$run"
    mkdir -p "$dir"
    count=$((BENCH_FTD_BYTES / size / QUEUES))
    [ "$count" -ge 1 ] || { log "$run: backlog smaller than one message per queue"; FAILED=1; return; }
    total=$((count * QUEUES))
    log "=== $run: $total messages of $size B ($(mib $((total * size))) MiB) into $QUEUES durable queues"

    # Broker.
    case "$target" in
        spill | memory)
            if [ "$target" = spill ]; then threshold_cfg="$THRESHOLD"; else threshold_cfg="$MEMORY_THRESHOLD"; fi
            if ! SPILLWAY_ENGINE__FLOW_TO_DISK_THRESHOLD="$threshold_cfg" start_spillway_all_in_one; then
                log "$run: spillway did not start"; FAILED=1; ROWS+=("$run|NOT STARTED"); stop_all_brokers "$run"; return
            fi
            pid="${SPW_SPILLWAY_PGIDS[0]}"
            metrics="$(json_get "$SPW_READY_FILE" metrics)"
            [ -n "$metrics" ] || log "$run: no metrics address in $SPW_READY_FILE"
            local in_force
            in_force="$(metric_sum "$metrics" spillway_broker_flow_to_disk_threshold_bytes)"
            [ "$in_force" = "$threshold_cfg" ] || log "$run: WARNING threshold in force $in_force, wanted $threshold_cfg"
            ;;
        rabbitmq)
            if ! start_rabbitmq; then
                log "$run: rabbitmq did not start"; FAILED=1; ROWS+=("$run|NOT STARTED"); stop_all_brokers "$run"; return
            fi
            # The same setting as vm_memory_high_watermark.absolute in rabbitmq.conf, at runtime
            # (the shared start_rabbitmq writes the config file itself).
            rabbitmq_ctl -q set_vm_memory_high_watermark absolute "$WATERMARK" >&2 ||
                { log "$run: set_vm_memory_high_watermark failed"; FAILED=1; stop_all_brokers "$run"; return; }
            rabbitmq_ctl status 2>/dev/null | grep -iE -A2 'memory high watermark|^RabbitMQ version|^Erlang' >"$dir/rabbitmq-status.txt" || true
            cat "$dir/rabbitmq-status.txt" >&2
            local server="${SPW_RABBIT_PGIDS[${#SPW_RABBIT_PGIDS[@]}-1]}"
            pid="$(ps -eo pid=,pgid=,comm= | awk -v g="$server" '$2 == g && $3 == "beam.smp" { print $1; exit }')"
            [ -n "$pid" ] || { log "$run: no beam.smp in process group $server"; FAILED=1; stop_all_brokers "$run"; return; }
            ;;
        *) log "unknown target $target"; FAILED=1; return ;;
    esac
    log "$run: broker pid $pid ($(cat "/proc/$pid/comm")), metrics ${metrics:-none}"

    # Sampler.
    : >"$dir/series.txt"
    sampler "$pid" "$metrics" "$dir/series.txt" &
    SAMPLER_PID=$!

    # shellcheck disable=SC2206
    local common=(--url "$BROKER_URL" --queue "ftd-$size" --queues "$QUEUES" --producers "$QUEUES"
        --consumers "$QUEUES" --size "$size" --count "$count" --durable --timeout "$PHASE_TIMEOUT"
        $LOADGEN_ARGS)
    load0="$(cut -d' ' -f1-3 /proc/loadavg)"
    sys0="$(system_cpu)"; cpu0="$(cpu_ticks "$pid")"
    t0="$(now_ms)"
    run_loadgen "$dir/publish.json" "${common[@]}" --no-consume --confirm
    pubrc=$RC
    t1="$(now_ms)"
    pub="$(grep '^{' "$dir/publish.json" | tail -n 1 || true)"

    # The backlog, as the broker sees it.
    local spilled="n/a" backlog_resident="n/a"
    if [ -n "$metrics" ]; then
        spilled="$(metric_sum "$metrics" spillway_queue_spilled_messages)"
        backlog_resident="$(metric_sum "$metrics" spillway_broker_resident_message_bytes)"
    elif [ "$target" = rabbitmq ]; then
        # Paged out = ready messages not in RAM (3.10 has no messages_paged_out key).
        rabbitmq_ctl -q list_queues --no-table-headers name durable messages messages_ram \
            message_bytes message_bytes_ram memory >"$dir/queues.txt" 2>&1 || true
        echo "name durable messages messages_ram message_bytes message_bytes_ram memory" >&2
        cat "$dir/queues.txt" >&2
        spilled="$(awk '$3 ~ /^[0-9]+$/ && $4 ~ /^[0-9]+$/ { s += $3 - $4; n = 1 } END { if (n) print s; else print "n/a" }' "$dir/queues.txt")"
    fi
    log "$run: after publish: spilled/paged-out messages $spilled, resident message bytes $backlog_resident"

    if [ "$pubrc" -lt 2 ]; then
        run_loadgen "$dir/drain.json" "${common[@]}" --consume-only
        drainrc=$RC
    else
        drainrc=2; : >"$dir/drain.json"
    fi
    t2="$(now_ms)"
    drain="$(grep '^{' "$dir/drain.json" | tail -n 1 || true)"
    cpu1="$(cpu_ticks "$pid")"; sys1="$(system_cpu)"
    load1="$(cut -d' ' -f1-3 /proc/loadavg)"
    sleep 1 # a last sample or so after the drain
    local end_resident="n/a" end_active="n/a"
    if [ -n "$metrics" ]; then
        end_resident="$(metric_sum "$metrics" spillway_broker_resident_message_bytes)"
        end_active="$(metric_sum "$metrics" spillway_broker_flow_to_disk_active)"
    fi
    stop_sampler
    local alive=yes
    spw_alive "$pid" || alive=no
    stop_all_brokers "$run"

    # Figures.
    local ser="$dir/series.txt" samples rss_idle rss_pub rss_drain rss_peak res_peak active_seen
    samples="$(wc -l <"$ser")"
    rss_pub="$(series_max "$ser" "$t0" "$t1" 2)"
    rss_drain="$(series_max "$ser" "$t1" "$t2" 2)"
    rss_peak="$(series_max "$ser" 0 99999999999999 2)"
    rss_idle="$(awk 'NR == 1 { print $2 }' "$ser")"
    res_peak="$(series_max "$ser" 0 99999999999999 3)"
    active_seen="$(series_max "$ser" 0 99999999999999 4)"
    cp "$ser" "$KEEP_DIR/$run.series.txt"

    local published confirmed consumed lost dup pub_rate drain_rate pub_mb drain_mb pub_s drain_s wall
    local tick busy_pct broker_cpu errs
    published="$(json_get "$pub" published)"; confirmed="$(json_get "$pub" confirmed)"
    consumed="$(json_get "$drain" consumed)"
    dup="$(json_get "$drain" duplicated)"
    pub_rate="$(json_get "$pub" publish_rate)"; pub_s="$(json_get "$pub" publish_elapsed_s)"
    drain_rate="$(json_get "$drain" consume_rate)"; drain_s="$(json_get "$drain" consume_elapsed_s)"
    drain_mb="$(json_get "$drain" mb_per_s)"
    pub_mb="$(awk -v r="${pub_rate:-0}" -v s="$size" 'BEGIN { printf "%.1f", r * s / 1e6 }')"
    # Lost: confirmed by the broker at publish time and never consumed (the drain run checks
    # that every sequence number 0..count of every producer arrives once).
    lost="$(json_get "$drain" lost)"
    if [ -n "$confirmed" ] && [ -n "$consumed" ]; then
        local by_count=$((confirmed - consumed + ${dup:-0}))
        [ "$by_count" -ge 0 ] || by_count=0
        [ -n "$lost" ] || lost="$by_count"
    fi
    wall="$(awk -v a="$t0" -v b="$t2" 'BEGIN { printf "%.1f", (b - a) / 1000 }')"
    tick="$(getconf CLK_TCK)"
    broker_cpu="$(awk -v a="$cpu0" -v b="$cpu1" -v t="$tick" 'BEGIN { printf "%.1f", (b - a) / t }')"
    busy_pct="$(awk -v a="$sys0" -v b="$sys1" 'BEGIN { split(a, x, " "); split(b, y, " ");
        d = y[2] - x[2]; if (d > 0) printf "%.0f", 100 * (y[1] - x[1]) / d; else print "n/a" }')"
    errs="$(grep -hcE ' (ERROR|WARN) ' "$KEEP_DIR/$run.broker.log" 2>/dev/null | head -n 1 || true)"

    local ok=yes why=()
    [ "$pubrc" -eq 0 ] || { ok=no; why+=("publish exit $pubrc"); }
    [ "$drainrc" -eq 0 ] || { ok=no; why+=("drain exit $drainrc"); }
    [ "$drainrc" -ne 3 ] && [ "$pubrc" -ne 3 ] || why+=("STALLED")
    [ "$alive" = yes ] || { ok=no; why+=("broker died"); }
    [ -n "$published" ] && [ "$published" = "$confirmed" ] || why+=("published ${published:-?} confirmed ${confirmed:-?}")
    if [ "$ok" != yes ]; then
        FAILED=1
        log "$run: FAILED: ${why[*]}"
        log "$run: publish: $pub"
        log "$run: drain: $drain"
    fi

    for f in pub_rate pub_mb drain_rate drain_mb rss_peak rss_pub rss_drain res_peak lost dup wall ok; do
        FIG["$target/$size/$f"]="${!f:-n/a}"
    done
    ROWS+=("$target|$size|$(mib "$threshold_cfg")|$pub_rate|$pub_mb|$drain_rate|${drain_mb:-n/a}|$(mib "$rss_peak")|$(mib "$rss_pub")|$(mib "$rss_drain")|$(mib "$res_peak")|$spilled|${lost:-n/a}|${dup:-n/a}|$wall|$busy_pct|$load0 -> $load1|$ok")

    printf '\n%s: %s x %s B, %s queue(s), threshold %s MiB\n' "$run" "$total" "$size" "$QUEUES" "$(mib "$threshold_cfg")"
    printf '  publish   %10s msg/s %8s MB/s  (%s s, confirmed %s/%s, blocked %s ms)\n' \
        "$pub_rate" "$pub_mb" "$pub_s" "${confirmed:-?}" "${published:-?}" "$(json_get "$pub" blocked_ms)"
    printf '  drain     %10s msg/s %8s MB/s  (%s s, consumed %s)\n' "$drain_rate" "${drain_mb:-n/a}" "$drain_s" "${consumed:-?}"
    printf '  peak RSS  %s MiB (publish %s, drain %s; idle at start %s; %s samples)\n' "$(mib "$rss_peak")" "$(mib "$rss_pub")" "$(mib "$rss_drain")" "$(mib "$rss_idle")" "$samples"
    printf '  resident  max %s MiB, after publish %s MiB, at end %s MiB; flow to disk seen active: %s, at end %s\n' \
        "$(mib "$res_peak")" "$(mib "$backlog_resident")" "$(mib "$end_resident")" "$active_seen" "$end_active"
    printf '  spilled   %s messages after publish\n' "$spilled"
    # What the RSS was made of when it peaked (Spillway: its own metrics, same sample).
    awk '$2 > m { m = $2; l = $0 } END { print l }' "$ser" | {
        read -r _ rss resident _ bookkeeping allocated heap store
        [ "${heap:--}" != - ] &&
            printf '  at peak   RSS %s MiB = heap %s MiB (live %s, of which resident messages %s, bookkeeping %s, RocksDB %s) + the rest %s MiB (code, stacks)\n' \
                "$(mib "$rss")" "$(mib "$heap")" "$(mib "$allocated")" "$(mib "$resident")" "$(mib "$bookkeeping")" \
                "$(mib "$store")" "$(mib $((rss - heap)))"
    } || true
    printf '  lost %s, duplicated %s, wall %s s, broker CPU %s s, machine busy %s%%, loadavg %s -> %s, broker log ERROR/WARN lines %s\n' \
        "${lost:-n/a}" "${dup:-n/a}" "$wall" "$broker_cpu" "$busy_pct" "$load0" "$load1" "${errs:-0}"

    jq -cn \
        --arg target "$target" --argjson size "$size" --argjson messages "$total" \
        --argjson backlog_bytes "$((total * size))" --argjson queues "$QUEUES" \
        --arg threshold "$threshold_cfg" --arg watermark "$([ "$target" = rabbitmq ] && echo "$WATERMARK" || echo n/a)" \
        --arg pub_rate "$pub_rate" --arg pub_mb "$pub_mb" --arg drain_rate "$drain_rate" --arg drain_mb "$drain_mb" \
        --arg rss_peak "$rss_peak" --arg rss_pub "$rss_pub" --arg rss_drain "$rss_drain" --arg rss_idle "${rss_idle:-}" \
        --arg res_peak "$res_peak" --arg spilled "$spilled" --arg end_resident "$end_resident" \
        --arg lost "${lost:-}" --arg dup "${dup:-}" --arg wall "$wall" --arg broker_cpu "$broker_cpu" \
        --arg busy "$busy_pct" --arg load0 "$load0" --arg load1 "$load1" --arg ok "$ok" \
        --arg date "$(date -u +%FT%TZ)" --arg host "$(hostname)" --argjson cores "$(nproc)" \
        --argjson publish "${pub:-null}" --argjson drain "${drain:-null}" '
        def num: if . == "" or . == "n/a" or . == "-" then null else tonumber end;
        {kind: "run", date: $date, host: $host, cores: $cores, target: $target, size: $size,
         messages: $messages, backlog_bytes: $backlog_bytes, queues: $queues,
         threshold_bytes: ($threshold | num), rabbitmq_watermark_bytes: ($watermark | num),
         publish_msg_s: ($pub_rate | num), publish_mb_s: ($pub_mb | num),
         drain_msg_s: ($drain_rate | num), drain_mb_s: ($drain_mb | num),
         peak_rss_bytes: ($rss_peak | num), peak_rss_publish_bytes: ($rss_pub | num),
         peak_rss_drain_bytes: ($rss_drain | num), idle_rss_bytes: ($rss_idle | num), max_resident_message_bytes: ($res_peak | num),
         spilled_messages_after_publish: ($spilled | num), end_resident_message_bytes: ($end_resident | num),
         lost: ($lost | num), duplicated: ($dup | num), wall_s: ($wall | num),
         broker_cpu_s: ($broker_cpu | num), machine_busy_pct: ($busy | num),
         loadavg_start: $load0, loadavg_end: $load1, ok: ($ok == "yes"),
         loadgen_publish: $publish, loadgen_drain: $drain}' >>"$RESULTS"
}

# stop_all_brokers RUN: stop whatever broker runs and keep its log.
stop_all_brokers() {
    local run="$1" f
    stop_spillway
    stop_rabbitmq
    for f in "$SPW_WORKDIR"/all-in-one/all-in-one.log "$SPW_WORKDIR"/rabbitmq/log/*.log; do
        [ -f "$f" ] || continue
        case "$f" in
            *all-in-one.log) cp "$f" "$KEEP_DIR/$run.broker.log" ;;
            *) cp "$f" "$KEEP_DIR/$run.$(basename "$f")" ;;
        esac
    done
    # A fresh broker (data dir, node) for the next run.
    rm -rf "$SPW_WORKDIR/all-in-one" "$SPW_WORKDIR/rabbitmq"
}

# ----------------------------------------------------------------------------- runs
log "backlog $BENCH_FTD_BYTES B per run, sizes: $BENCH_FTD_SIZES, targets: $BENCH_FTD_TARGETS"
log "machine: $(nproc) cores, $(awk '/MemTotal/ { printf "%.1f GiB", $2 / 1048576 }' /proc/meminfo), loadavg $(cut -d' ' -f1-3 /proc/loadavg)"
START_LOAD="$(cut -d' ' -f1-3 /proc/loadavg)"
for size in $BENCH_FTD_SIZES; do
    for target in $BENCH_FTD_TARGETS; do
        bench_run "$target" "$size"
    done
done

# ----------------------------------------------------------------------------- table
echo
printf 'flow to disk: %s B backlog per run, %s durable queue(s), transient messages, confirms; %s cores, loadavg %s at start, %s at end\n' \
    "$BENCH_FTD_BYTES" "$QUEUES" "$(nproc)" "$START_LOAD" "$(cut -d' ' -f1-3 /proc/loadavg)"
fmt='%-8s | %6s | %9s | %9s | %7s | %9s | %7s | %9s | %9s | %9s | %9s | %8s | %5s | %7s | %5s | %s\n'
# shellcheck disable=SC2059
printf "$fmt" target size "thr MiB" "pub msg/s" "pub MB/s" "drain m/s" "drn MB/s" "RSS MiB" "RSS pub" "RSS drain" "resid MiB" spilled lost "wall s" busy% "loadavg"
printf '%s\n' "---------+--------+-----------+-----------+---------+-----------+---------+-----------+-----------+-----------+-----------+----------+-------+---------+-------+----------------"
for row in "${ROWS[@]}"; do
    IFS='|' read -r t s thr pr pm dr dm rss rp rd res sp lost _dup wall busy load ok <<<"$row"
    [ "${ok:-no}" = yes ] || t="$t!"
    # shellcheck disable=SC2059
    printf "$fmt" "$t" "$s" "$thr" "$pr" "$pm" "$dr" "$dm" "$rss" "$rp" "$rd" "$res" "$sp" "$lost" "$wall" "$busy" "$load"
done
echo "(RSS: peak VmRSS of the broker process, beam.smp for RabbitMQ; resid: max spillway_broker_resident_message_bytes;"
echo " spilled: messages only on disk after publishing (RabbitMQ: messages - messages_ram); '!' marks a failed run)"

# ----------------------------------------------------------------------------- promises
echo
echo "promises (flow to disk):"
BROKEN=0
promise() { # DESCRIPTION RESULT(yes/no/n/a)
    printf '  %-72s %s\n' "$1" "$2"
    [ "$2" != no ] || BROKEN=1
}
ge() { awk -v a="$1" -v b="$2" 'BEGIN { if (a == "n/a" || b == "n/a" || a == "" || b == "") print "n/a"; else if (a + 0 >= b + 0) print "yes"; else print "no" }'; }
for size in $BENCH_FTD_SIZES; do
    rss="${FIG[spill/$size/rss_peak]:-n/a}"
    if [ "$rss" != n/a ]; then
        promise "$size B: spill peak RSS $(mib "$rss") MiB <= threshold + 128 MiB = $(mib $((THRESHOLD + RSS_SLACK))) MiB" \
            "$(ge $((THRESHOLD + RSS_SLACK)) "$rss")"
    fi
    for f in pub_rate drain_rate; do
        s="${FIG[spill/$size/$f]:-n/a}"; m="${FIG[memory/$size/$f]:-n/a}"
        [ "$s" != n/a ] && [ "$m" != n/a ] || continue
        half="$(awk -v m="$m" 'BEGIN { printf "%.1f", m / 2 }')"
        pct="$(awk -v s="$s" -v m="$m" 'BEGIN { if (m > 0) printf "%.0f", 100 * s / m; else print "n/a" }')"
        promise "$size B: spill ${f%_rate} $s msg/s >= 50% of in-memory $m msg/s ($pct%)" "$(ge "$s" "$half")"
    done
    for t in $BENCH_FTD_TARGETS; do
        l="${FIG[$t/$size/lost]:-n/a}"
        r="n/a"; [ "$l" = n/a ] || r="$([ "$l" = 0 ] && echo yes || echo no)"
        promise "$size B: $t lost $l (zero loss)" "$r"
    done
done
printf 'raw results: %s; series and broker logs: %s/\n' "$RESULTS" "$KEEP_DIR"
jq -cn --arg date "$(date -u +%FT%TZ)" --argjson broken "$BROKEN" --argjson failed "$FAILED" \
    '{kind: "summary", date: $date, promises_broken: ($broken == 1), runs_failed: ($failed == 1)}' >>"$RESULTS"

[ "$FAILED" = 0 ] || exit 1
if [ "${BENCH_FTD_STRICT:-0}" = 1 ] && [ "$BROKEN" = 1 ]; then exit 2; fi
exit 0
