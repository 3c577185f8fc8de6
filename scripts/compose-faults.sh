#!/usr/bin/env bash
# `make compose-faults`: fault drills under persistent, confirmed traffic.
#
# The loadgen-faults service (profile `faults`) publishes through `gateway`
# and consumes through `gateway2`, reconnecting after every lost connection.
# While it runs: docker kill (then start) the storage node, the engine, each
# gateway; then cut engine<->storage (docker network disconnect from the
# `back` network) for 10 s. Then publishing stops (SIGTERM), the consumers
# drain, and the run fails if any *confirmed* message was never consumed.
# Always tears down.
set -euo pipefail
source "$(dirname "$0")/compose-common.sh"
docker_check
docker image inspect spillway:local >/dev/null 2>&1 || die "no spillway:local image: run 'make images' first"
compose_setup faults
DOWN="${SPILLWAY_FAULTS_DOWN:-5}"        # seconds a killed container stays down
SETTLE="${SPILLWAY_FAULTS_SETTLE:-8}"    # seconds of traffic between drills
CUT="${SPILLWAY_FAULTS_CUT:-10}"         # seconds engine<->storage stays cut
out="$root/target/compose"
mkdir -p "$out"
log="$out/compose-faults.log"
report="$out/compose-faults-report.txt"
summary="$out/compose-faults-summary.json"
: >"$report"
trap compose_teardown EXIT

say() { echo "compose-faults: $*" | tee -a "$report"; }

# The loadgen's latest progress line, as "published confirmed consumed reconnects".
progress() {
    local line
    line="$(docker logs "$loadgen" 2>&1 | grep 'progress' | tail -n1 \
        | sed -E 's/.*published=([0-9]+) confirmed=([0-9]+) consumed=([0-9]+) reconnects=([0-9]+).*/\1 \2 \3 \4/' || true)"
    echo "${line:-0 0 0 0}"
}

say "project $PROJECT, using ${COMPOSE[*]}; down ${DOWN} s per kill, ${SETTLE} s between drills, ${CUT} s cut"
start=$SECONDS
compose up -d >"$log" 2>&1
for s in storage engine gateway gateway2 management; do wait_healthy "$s" 120; done

# Isolation (docs/security.md): a client container on `front` reaches the
# gateways, and neither the engine nor storage nor management (each probed on
# its /healthz port, 9470, which answers anyone who can connect).
front_net="$(docker network ls -q --filter "label=com.docker.compose.project=$PROJECT" \
    --filter "label=com.docker.compose.network=front")"
[[ -n "$front_net" ]] || die "no front network for $PROJECT"
from_front() {
    docker run --rm --network "$front_net" --entrypoint /usr/local/bin/spillway \
        spillway:local healthcheck --addr "$1" >/dev/null 2>&1
}
from_front gateway:9470 || die "a client on the front network cannot reach the gateway"
for target in engine:9470 storage:9470 management:9470; do
    if from_front "$target"; then
        die "a client on the front network reached $target"
    fi
done
say "isolation: a client on front reaches gateway, not engine, storage or management"
export SPILLWAY_LOADGEN_LOG="${SPILLWAY_LOADGEN_LOG:-warn,lapin=off}"
compose --profile faults up -d --no-deps loadgen-faults >>"$log" 2>&1
loadgen="$(cid loadgen-faults)"
[[ -n "$loadgen" ]] || die "loadgen-faults did not start"
sleep "$SETTLE"
say "traffic running: $(progress) (published confirmed consumed reconnects)"

# kill_drill SERVICE [OTHER SERVICES THAT MUST BE HEALTHY AGAIN]
kill_drill() {
    local service="$1"; shift
    local id before after t0
    id="$(cid "$service")"
    before="$(progress)"
    t0=$SECONDS
    docker kill "$id" >/dev/null
    sleep "$DOWN"
    docker start "$id" >/dev/null
    wait_healthy "$service" 180
    for other in "$@"; do wait_healthy "$other" 180; done
    local back=$((SECONDS - t0))
    sleep "$SETTLE"
    after="$(progress)"
    say "kill $service: down ${DOWN} s, healthy again after ${back} s; progress ${before} -> ${after}"
    # Traffic must be moving again: more confirms after the drill than before.
    read -r _ c0 _ _ <<<"$before"
    read -r _ c1 _ _ <<<"$after"
    if (( c1 <= c0 )); then
        say "  FAIL: no confirm after the $service restart"
        return 1
    fi
}

kill_drill storage engine
kill_drill engine gateway gateway2
kill_drill gateway
kill_drill gateway2

# Engine <-> storage cut: only the engine leaves the `back` network.
engine="$(cid engine)"
back_net="$(docker network ls -q --filter "label=com.docker.compose.project=$PROJECT" \
    --filter "label=com.docker.compose.network=back")"
[[ -n "$back_net" ]] || die "no back network for $PROJECT"
before="$(progress)"
docker network disconnect "$back_net" "$engine"
sleep 2
during0="$(progress)"
sleep "$((CUT - 2))"
during1="$(progress)"
docker network connect "$back_net" "$engine"
sleep "$SETTLE"
after="$(progress)"
read -r p0 c0 _ r0 <<<"$during0"
read -r p1 c1 _ r1 <<<"$during1"
read -r _ c2 _ r2 <<<"$after"
say "cut engine<->storage ${CUT} s: progress ${before} -> ${during0} -> ${during1} (cut ends) -> ${after}"
say "  during the cut (from 2 s in): published +$((p1 - p0)), confirmed +$((c1 - c0)), reconnects +$((r1 - r0)); after: confirmed +$((c2 - c1)), reconnects +$((r2 - r1))"
partition_ok=1
if (( r1 != r0 )); then say "  FAIL: clients lost their connections during the cut (expected: blocked, not failed)"; partition_ok=0; fi
if (( c2 <= c1 )); then say "  FAIL: confirms did not resume after the cut"; partition_ok=0; fi
if (( c1 - c0 > 0 )); then say "  note: confirms went on during the cut (+$((c1 - c0)))"; fi

# Stop publishing, let the consumers drain, read the verdict.
docker kill -s TERM "$loadgen" >/dev/null
rc="$(docker wait "$loadgen")"
docker logs "$loadgen" 2>/dev/null | tail -n1 >"$summary" || true
if command -v python3 >/dev/null 2>&1 && python3 -c 'import json,sys; json.load(open(sys.argv[1]))' "$summary" 2>/dev/null; then
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
if [[ "$rc" != 0 || $partition_ok != 1 ]]; then
    exit 1
fi
