#!/usr/bin/env bash
# `make compose-test`: the compose stack with its `test` profile. The loadgen
# runs deploy/loadgen-test.json (mixed transient/persistent traffic through two
# gateways, a backlog past the flow-to-disk threshold, a queue at capacity) and
# exits non-zero on any lost or duplicated message. Always tears down.
set -euo pipefail
source "$(dirname "$0")/compose-common.sh"
docker_check
docker image inspect spillway:local >/dev/null 2>&1 || die "no spillway:local image: run 'make images' first"
compose_setup test
# The flow-to-disk step publishes a backlog of about 4x this (64 MiB).
export SPILLWAY_BROKER__FLOW_TO_DISK_THRESHOLD="${SPILLWAY_BROKER__FLOW_TO_DISK_THRESHOLD:-67108864}"
out="$root/target/compose"
mkdir -p "$out"
log="$out/compose-test.log"
summary="$out/compose-test-summary.json"
trap compose_teardown EXIT

echo "compose-test: project $PROJECT, using ${COMPOSE[*]}, flow-to-disk threshold $SPILLWAY_BROKER__FLOW_TO_DISK_THRESHOLD bytes"
start=$SECONDS
rc=0
compose --profile test up --exit-code-from loadgen --no-color >"$log" 2>&1 || rc=$?
elapsed=$((SECONDS - start))
loadgen="$(cid loadgen)"
if [[ -n "$loadgen" ]]; then
    docker logs "$loadgen" 2>/dev/null | tail -n1 >"$summary" || true
    docker logs "$loadgen" 2>&1 >/dev/null | grep -E 'step|signal|gave up|error' | sed 's/^/loadgen: /' || true
fi
echo "compose-test: loadgen summary ($summary):"
if command -v python3 >/dev/null 2>&1 && python3 -c 'import json,sys; json.load(open(sys.argv[1]))' "$summary" 2>/dev/null; then
    python3 - "$summary" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"  ok={s['ok']} elapsed={s['elapsed_s']} s published={s['published']} confirmed={s['confirmed']} "
      f"consumed={s['consumed']} lost={s['lost']} duplicated={s['duplicated']} blocked_ms={s['blocked_ms']}")
for step in s["steps"]:
    for r in step["runs"]:
        print(f"  {r.get('name')}: published={r['published']} consumed={r['consumed']} lost={r['lost']} "
              f"dup={r['duplicated']} {r['publish_rate']} msg/s in, {r['consume_rate']} msg/s out, "
              f"p99 {r['latency_p99_ms']} ms, blocked {r['blocked_ms']} ms, errors={r['errors']}")
PY
else
    cat "$summary" 2>/dev/null || echo "  (none: the loadgen did not finish; log in $log)"
fi
echo "compose-test: exit $rc after ${elapsed} s (compose log: $log)"
if [[ $rc -ne 0 ]]; then
    tail -n 60 "$log" >&2
fi
exit "$rc"
