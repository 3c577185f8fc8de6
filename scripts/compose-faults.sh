#!/usr/bin/env bash
# `make compose-faults`: fault drills under persistent, confirmed traffic, on
# the compose deployment (three storage nodes, two engines, two gateways).
#
# The loadgen-faults service (profile `faults`) publishes through `gateway`
# and consumes through `gateway2`, reconnecting after every lost connection.
# While it runs, one drill after another (docs/replication.md):
#   1. kill the storage leader (SIGKILL), start it again 5 s later;
#   2. cut a storage follower off the network for 10 s: confirms go on (a
#      majority remains); back, it catches up with the leader;
#   3. kill two of the three storage nodes: nothing is confirmed (no
#      majority); one back, confirms resume; then the other;
#   4. kill the active engine: the standby takes the lease, clients
#      reconnect (320 from the gateways), confirms resume;
#   5. kill a storage follower and wipe its disk, then let it rejoin: it
#      catches up from a snapshot (SPILLWAY_FAULTS_WIPE=0 skips it);
#   6. kill each gateway;
#   7. cut the active engine off the storage nodes for 10 s: it steps down
#      (its lease lapses), the standby takes over.
# Each drill prints the confirms it saw and how long confirms stood still
# (publishers blocked). Then publishing stops (SIGTERM), the consumers drain,
# and the run fails if any *confirmed* message was never consumed; the
# summary gives lost, duplicated and redelivered for the whole run.
# Always tears down.
set -euo pipefail
source "$(dirname "$0")/compose-common.sh"
docker_check
docker image inspect spillway:local >/dev/null 2>&1 || die "no spillway:local image: run 'make images' first"
compose_setup faults
DOWN="${SPILLWAY_FAULTS_DOWN:-5}"        # seconds a killed container stays down
SETTLE="${SPILLWAY_FAULTS_SETTLE:-8}"    # seconds of traffic between drills
CUT="${SPILLWAY_FAULTS_CUT:-10}"         # seconds a cut lasts
out="$root/target/compose"
mkdir -p "$out"
log="$out/compose-faults.log"
report="$out/compose-faults-report.txt"
summary="$out/compose-faults-summary.json"
samples="$out/compose-faults-samples.txt"
: >"$report"
: >"$samples"
sampler=""
stop_sampler() { [[ -z "$sampler" ]] || kill "$sampler" 2>/dev/null || true; }
# compose_teardown reads the exit status (it prints the logs on failure).
trap 'rc=$?; set +e; stop_sampler; (exit $rc); compose_teardown' EXIT

spillctl="${SPILLCTL_BIN:-$root/target/release/spillctl}"
[[ -x "$spillctl" ]] || die "$spillctl missing: build it first (make test-build)"
export SPILLWAY_MANAGEMENT_TOKEN="${SPILLWAY_MANAGEMENT_TOKEN:-$(head -c 24 /dev/urandom | base64 | tr -d '/+=')}"

say() { echo "compose-faults: $*" | tee -a "$report"; }
fail() { say "  FAIL: $*"; failed=1; }
failed=0
STORAGE=(storage-1 storage-2 storage-3)
ENGINES=(engine-1 engine-2)

# The loadgen's latest progress line, as "published confirmed consumed reconnects".
progress() {
    local line
    line="$(docker logs "$loadgen" 2>&1 | grep 'progress' | tail -n1 \
        | sed -E 's/.*published=([0-9]+) confirmed=([0-9]+) consumed=([0-9]+) reconnects=([0-9]+).*/\1 \2 \3 \4/' || true)"
    echo "${line:-0 0 0 0}"
}
confirmed() { local p; p="$(progress)"; read -r _ c _ _ <<<"$p"; echo "$c"; }

# Every half second: "<seconds since start, ms> <confirmed>", for the stalls.
sample_forever() {
    while :; do
        echo "$(( $(date +%s%3N) - t0_ms )) $(confirmed)" >>"$samples"
        sleep 0.5
    done
}
now_ms() { echo $(( $(date +%s%3N) - t0_ms )); }
# The longest stretch (ms) in [FROM, TO] during which confirms stood still.
longest_stall() {
    awk -v from="$1" -v to="$2" '
        $1 < from || $1 > to { next }
        { if (last == "" || $2 != last) { if (since != "" && $1 - since > worst) worst = $1 - since; since = $1; last = $2 } }
        END { if (since != "" && to - since > worst && last != "") worst = to - since; print worst + 0 }
    ' "$samples"
}

ctl() {
    "$spillctl" --addr "localhost:$mport" --tls-ca "$root/deploy/certs/client-ca.pem" \
        --token "$SPILLWAY_MANAGEMENT_TOKEN" "$@"
}
# The storage group as the leader sees it: "leader id role:applied:lag ...".
group_line() {
    ctl --output json storage status 2>/dev/null | python3 -c '
import json, sys
g = json.load(sys.stdin)
members = ["%s:%s:%s:%s" % (m["id"], m["role"], m.get("applied_index", 0), m.get("lag", 0))
           for m in g.get("members", [])]
print(g.get("leader", 0), " ".join(members))
' 2>/dev/null || echo "0"
}
leader_id() { local l; l="$(group_line)"; echo "${l%% *}"; }
# Waits (up to $1 s) for a leader that is not node $2 (0: any leader).
wait_leader() {
    local limit="$1" not="${2:-x}" start=$SECONDS id
    while :; do
        id="$(leader_id)"
        if [[ -n "$id" && "$id" != 0 && "$id" != "$not" ]]; then echo "$id"; return 0; fi
        (( SECONDS - start < limit )) || return 1
        sleep 0.5
    done
}
# Waits (up to $2 s) until node $1 is a follower with no lag.
wait_caught_up() {
    local node="$1" limit="$2" start=$SECONDS line
    while :; do
        line="$(group_line)"
        if grep -Eq "(^| )$node:follower:[0-9]+:0( |$)" <<<"$line"; then return 0; fi
        (( SECONDS - start < limit )) || { say "  group: $line"; return 1; }
        sleep 0.5
    done
}
# The serving engine other than $1, or "" (its /healthz says ok; the
# standby's says standby).
active_engine_except() {
    local e
    for e in "${ENGINES[@]}"; do
        [[ "$e" == "$1" ]] && continue
        if [[ "$(docker exec "$(cid "$e")" /usr/local/bin/spillway healthcheck --addr 127.0.0.1:9470 2>/dev/null)" == ok ]]; then
            echo "$e"; return 0
        fi
    done
    echo ""
}
# The engine serving.
active_engine() { active_engine_except ""; }
wait_active_engine() {
    local limit="$1" start=$SECONDS e
    while :; do
        e="$(active_engine)"
        if [[ -n "$e" ]]; then echo "$e"; return 0; fi
        (( SECONDS - start < limit )) || return 1
        sleep 0.5
    done
}
# Waits (up to $1 s) until an engine other than $2 serves, and prints it.
wait_engine_other_than() {
    local limit="$1" old="$2" start=$SECONDS e
    while :; do
        e="$(active_engine_except "$old")"
        if [[ -n "$e" ]]; then echo "$e"; return 0; fi
        (( SECONDS - start < limit )) || return 1
        sleep 0.5
    done
}
# Waits (up to $1 s) for confirms past $2.
wait_confirms_past() {
    local limit="$1" c0="$2" start=$SECONDS
    while (( $(confirmed) <= c0 )); do
        (( SECONDS - start < limit )) || return 1
        sleep 0.5
    done
}
# drill_report NAME FROM_MS: what the drill saw since FROM_MS.
drill_report() {
    local name="$1" from="$2" before="$3" after
    after="$(progress)"
    read -r _ c0 _ r0 <<<"$before"
    read -r _ c1 _ r1 <<<"$after"
    say "$name: confirmed +$((c1 - c0)), reconnects +$((r1 - r0)), confirms stood still at most $(longest_stall "$from" "$(now_ms)") ms"
}
net_of() {
    docker network ls -q --filter "label=com.docker.compose.project=$PROJECT" \
        --filter "label=com.docker.compose.network=$1"
}

say "project $PROJECT, using ${COMPOSE[*]}; down ${DOWN} s per kill, ${SETTLE} s between drills, ${CUT} s cuts"
start=$SECONDS
compose up -d >"$log" 2>&1
for s in "${STORAGE[@]}" "${ENGINES[@]}" gateway gateway2 management; do wait_healthy "$s" 120; done
mport="$(compose port management 50051 | sed 's/.*://')"
[[ -n "$mport" ]] || die "management's port is not published"

# Isolation (docs/security.md): a client container on `front` reaches the
# gateways, and neither an engine nor storage nor management (each probed on
# its /healthz port, 9470, which answers anyone who can connect).
front_net="$(net_of front)"
[[ -n "$front_net" ]] || die "no front network for $PROJECT"
from_front() {
    docker run --rm --network "$front_net" --entrypoint /usr/local/bin/spillway \
        spillway:local healthcheck --addr "$1" >/dev/null 2>&1
}
from_front gateway:9470 || die "a client on the front network cannot reach the gateway"
for target in engine-1:9470 engine-2:9470 storage-1:9470 management:9470; do
    if from_front "$target"; then
        die "a client on the front network reached $target"
    fi
done
say "isolation: a client on front reaches gateway, not an engine, storage or management"

leader="$(wait_leader 60)" || die "the storage group has no leader"
active="$(wait_active_engine 60)" || die "no engine is active"
say "storage group: $(group_line); active engine: $active"

export SPILLWAY_LOADGEN_LOG="${SPILLWAY_LOADGEN_LOG:-warn,lapin=off}"
compose --profile faults up -d --no-deps loadgen-faults >>"$log" 2>&1
loadgen="$(cid loadgen-faults)"
[[ -n "$loadgen" ]] || die "loadgen-faults did not start"
t0_ms="$(date +%s%3N)"
sample_forever &
sampler=$!
sleep "$SETTLE"
say "traffic running: $(progress) (published confirmed consumed reconnects)"

# 1. The storage leader dies.
leader="$(wait_leader 30)" || die "no storage leader"
before="$(progress)"; from="$(now_ms)"
docker kill "$(cid "storage-$leader")" >/dev/null
new_leader="$(wait_leader 30 "$leader")" || fail "no new storage leader within 30 s of killing storage-$leader"
sleep "$DOWN"
docker start "$(cid "storage-$leader")" >/dev/null
wait_healthy "storage-$leader" 120
wait_confirms_past 60 "$(read -r _ c _ _ <<<"$before"; echo "$c")" || fail "no confirm after the storage leader's death"
wait_caught_up "$leader" 120 || fail "storage-$leader did not catch up after its restart"
sleep "$SETTLE"
drill_report "kill the storage leader (storage-$leader; storage-${new_leader:-?} took over)" "$from" "$before"

# 2. A follower is cut off, and comes back.
leader="$(wait_leader 30)" || die "no storage leader"
follower=1; while [[ "$follower" == "$leader" ]]; do follower=$((follower + 1)); done
back_net="$(net_of back)"
[[ -n "$back_net" ]] || die "no back network for $PROJECT"
before="$(progress)"; from="$(now_ms)"
docker network disconnect "$back_net" "$(cid "storage-$follower")"
sleep "$CUT"
during="$(progress)"
# --alias: reconnected by hand, a container keeps only its own name on the
# network, and the others dial it by its service name.
docker network connect --alias "storage-$follower" "$back_net" "$(cid "storage-$follower")"
read -r _ c0 _ _ <<<"$before"; read -r _ c1 _ _ <<<"$during"
(( c1 > c0 )) || fail "no confirm while one follower of three was cut off"
wait_caught_up "$follower" 120 || fail "storage-$follower did not catch up after the cut"
sleep "$SETTLE"
drill_report "cut follower storage-$follower off ${CUT} s (confirmed during the cut +$((c1 - c0)); caught up)" "$from" "$before"

# 3. Two of three die: nothing is confirmed until one is back.
leader="$(wait_leader 30)" || die "no storage leader"
a="storage-$leader"; b="storage-$(( leader % 3 + 1 ))"
before="$(progress)"; from="$(now_ms)"
docker kill "$(cid "$a")" "$(cid "$b")" >/dev/null
sleep 3   # what was committed before the kill may still be confirmed
c0="$(confirmed)"
sleep "$DOWN"
c1="$(confirmed)"
(( c1 == c0 )) || fail "$((c1 - c0)) confirms while two of three storage nodes were down"
docker start "$(cid "$a")" >/dev/null
wait_confirms_past 90 "$c1" || fail "no confirm once $a was back"
docker start "$(cid "$b")" >/dev/null
wait_healthy "$a" 120; wait_healthy "$b" 120
sleep "$SETTLE"
drill_report "kill $a and $b (no majority: confirmed +0 over ${DOWN} s; resumed with $a back)" "$from" "$before"

# 4. The active engine dies: the standby takes over.
active="$(wait_active_engine 30)" || die "no engine is active"
before="$(progress)"; from="$(now_ms)"
docker kill "$(cid "$active")" >/dev/null
# The standby must take over by itself (the lease lapses in 5 s) before
# the killed engine is started again, to stand by.
took_over="$(wait_engine_other_than 60 "$active")" || fail "no engine took over from $active"
docker start "$(cid "$active")" >/dev/null
wait_healthy "$active" 120
wait_confirms_past 60 "$(read -r _ c _ _ <<<"$before"; echo "$c")" || fail "no confirm after $active died"
sleep "$SETTLE"
drill_report "kill the active engine ($active; ${took_over:-none} serves now, $active stands by)" "$from" "$before"

# 5. A follower loses its disk and rejoins under its old id: it takes the
# leader's snapshot and the log, and withholds its vote until it has caught
# up (docs/replication.md). SPILLWAY_FAULTS_WIPE=0 skips it.
if [[ "${SPILLWAY_FAULTS_WIPE:-1}" == 1 ]]; then
leader="$(wait_leader 30)" || die "no storage leader"
wiped=1; while [[ "$wiped" == "$leader" ]]; do wiped=$((wiped + 1)); done
before="$(progress)"; from="$(now_ms)"
docker kill "$(cid "storage-$wiped")" >/dev/null
docker rm -f "$(cid "storage-$wiped")" >/dev/null
docker volume ls -q --filter "label=com.docker.compose.project=$PROJECT" \
    --filter "label=com.docker.compose.volume=storage-${wiped}-data" | xargs -r docker volume rm >/dev/null
compose up -d --no-deps "storage-$wiped" >>"$log" 2>&1
wait_healthy "storage-$wiped" 120
wait_caught_up "$wiped" 180 || fail "storage-$wiped did not catch up after losing its disk"
sleep "$SETTLE"
drill_report "wipe storage-$wiped's disk (rejoined and caught up)" "$from" "$before"
else
    say "wipe a follower's disk: skipped (SPILLWAY_FAULTS_WIPE=0)"
fi

# 6. Each gateway dies.
for gw in gateway gateway2; do
    before="$(progress)"; from="$(now_ms)"
    docker kill "$(cid "$gw")" >/dev/null
    sleep "$DOWN"
    docker start "$(cid "$gw")" >/dev/null
    wait_healthy "$gw" 120
    wait_confirms_past 60 "$(read -r _ c _ _ <<<"$before"; echo "$c")" || fail "no confirm after $gw restarted"
    sleep "$SETTLE"
    drill_report "kill $gw" "$from" "$before"
done

# 7. The active engine is cut off the store: it steps down, the standby
# takes over, and the clients reconnect to it.
active="$(wait_active_engine 30)" || die "no engine is active"
before="$(progress)"; from="$(now_ms)"
cut_at="$(date +%s)"
docker network disconnect "$back_net" "$(cid "$active")"
sleep "$CUT"
docker network connect --alias "$active" "$back_net" "$(cid "$active")"
# Its lease lapses during the cut (5 s TTL): the standby must take it, and
# the cut engine, reconnected, must step down rather than serve on.
took_over="$(wait_engine_other_than 60 "$active")" || fail "the standby did not take over from $active, cut off"
stepped_down=0
for _ in $(seq 120); do
    if docker logs --since "$cut_at" "$(cid "$active")" 2>&1 | grep -q "MST-1101.*stops serving"; then
        stepped_down=1; break
    fi
    sleep 0.5
done
(( stepped_down )) || fail "$active, cut off and back, did not step down (no MST-1101 in its log)"
wait_confirms_past 60 "$(read -r _ c _ _ <<<"$before"; echo "$c")" || fail "no confirm after $active was cut off"
wait_healthy "$active" 120
sleep "$SETTLE"
drill_report "cut the active engine ($active) off the store ${CUT} s (${took_over} serves now, $active stepped down)" "$from" "$before"
say "storage group at the end: $(group_line)"

# Stop publishing, let the consumers drain, read the verdict. The loadgen
# bounds its own drain (--timeout=180 after its confirms settle); a loadgen
# still running well past that is a hang to report, not to wait out.
stop_sampler
docker kill -s TERM "$loadgen" >/dev/null
if ! rc="$(timeout "${SPILLWAY_FAULTS_DRAIN_LIMIT:-420}" docker wait "$loadgen")"; then
    say "FAIL: the loadgen did not finish within ${SPILLWAY_FAULTS_DRAIN_LIMIT:-420} s of SIGTERM; its last lines:"
    docker logs "$loadgen" 2>&1 | tail -n 20 | tee -a "$report"
    exit 1
fi
docker logs "$loadgen" 2>/dev/null | tail -n1 >"$summary" || true
if python3 -c 'import json,sys; json.load(open(sys.argv[1]))' "$summary" 2>/dev/null; then
    python3 - "$summary" <<'PY' | tee -a "$report"
import json, sys
s = json.load(open(sys.argv[1]))
print(f"compose-faults: loadgen ok={s['ok']}: published={s['published']} confirmed={s['confirmed']} "
      f"consumed={s['consumed']} confirmed_lost={s['confirmed_lost']} unconfirmed={s['unconfirmed']} "
      f"lost(incl. unconfirmed)={s['lost']} duplicated={s['duplicated']} redelivered={s['redelivered']} "
      f"out_of_order={s['out_of_order']} reconnects={s['reconnects']} errors={s['errors']}")
PY
else
    say "no summary from the loadgen: $(cat "$summary" 2>/dev/null)"
fi
say "loadgen exit $rc; drills and drain took $((SECONDS - start)) s (report: $report)"
if [[ "$rc" != 0 || $failed != 0 ]]; then
    exit 1
fi
