#!/usr/bin/env bash
# `make compose-test`: the compose stack with its `test` profile. The loadgen
# runs deploy/loadgen-test.json (mixed transient/persistent traffic through two
# gateways, a backlog past the flow-to-disk threshold, a queue at capacity) and
# exits non-zero on any lost or duplicated message. Producers publish over
# AMQPS, consumers consume over AMQP, internal gRPC is mutual TLS, and spillctl
# checks management over TLS (--tls-ca) before the load. Always tears down.
set -euo pipefail
source "$(dirname "$0")/compose-common.sh"
docker_check
docker image inspect spillway:local >/dev/null 2>&1 || die "no spillway:local image: run 'make images' first"
compose_setup test
# The flow-to-disk step publishes a backlog of about 4x this (64 MiB).
export SPILLWAY_ENGINE__FLOW_TO_DISK_THRESHOLD="${SPILLWAY_ENGINE__FLOW_TO_DISK_THRESHOLD:-67108864}"
out="$root/target/compose"
mkdir -p "$out"
log="$out/compose-test.log"
summary="$out/compose-test-summary.json"
trap compose_teardown EXIT

# spillctl from the host, over TLS to management's published port.
spillctl="${SPILLCTL_BIN:-$root/target/release/spillctl}"
[[ -x "$spillctl" ]] || die "$spillctl missing: build it first (make test-build)"
export SPILLWAY_MANAGEMENT_TOKEN="${SPILLWAY_MANAGEMENT_TOKEN:-$(head -c 24 /dev/urandom | base64 | tr -d '/+=')}"

echo "compose-test: project $PROJECT, using ${COMPOSE[*]}, flow-to-disk threshold $SPILLWAY_ENGINE__FLOW_TO_DISK_THRESHOLD bytes"
start=$SECONDS
rc=0
# The stack first (internal gRPC over mutual TLS), then spillctl, then the
# loadgen (producers over AMQPS, consumers over AMQP).
compose up -d >"$log" 2>&1 || die "the stack did not start (log: $log)"
for s in storage-1 storage-2 storage-3 engine-1 engine-2 gateway gateway2 management; do
    wait_healthy "$s" 120
done
mport="$(compose port management 50051 | sed 's/.*://')"
[[ -n "$mport" ]] || die "management's port is not published"
ctl() {
    "$spillctl" --addr "localhost:$mport" --token "$SPILLWAY_MANAGEMENT_TOKEN" "$@"
}
ctl --tls-ca "$root/deploy/certs/client-ca.pem" status >"$out/compose-test-spillctl.txt" 2>&1 \
    || { cat "$out/compose-test-spillctl.txt" >&2; die "spillctl --tls-ca could not reach management over TLS"; }
if ctl status >/dev/null 2>&1; then
    die "spillctl reached management without TLS: the port should serve TLS only"
fi
if ctl --tls-ca "$root/deploy/certs/cluster-ca.pem" status >/dev/null 2>&1; then
    die "spillctl accepted management's certificate with the wrong CA"
fi
echo "compose-test: spillctl --tls-ca reached management over TLS (plaintext and a wrong CA refused)"
# Nothing is published beyond the host's loopback, and the first
# administrator's password is the one made on this machine, not a known one.
for published in "management 50051" "gateway 5672" "gateway 5671" "gateway2 5672" "gateway2 5671"; do
    # shellcheck disable=SC2086
    bound="$(compose port $published)"
    [[ "$bound" == 127.0.0.1:* ]] || die "$published is published on '$bound', not on loopback"
done
admin() {
    "$spillctl" --addr "localhost:$mport" --tls-ca "$root/deploy/certs/client-ca.pem" --user spillway "$@"
}
admin --password "$(tr -d '\n' <"$root/deploy/admin-password")" status >/dev/null 2>&1 \
    || die "the administrator made by deploy/admin-credentials.sh cannot log in to management"
if admin --password spillway status >/dev/null 2>&1; then
    die "management accepted spillway/spillway: the administrator's password is the repository's"
fi
echo "compose-test: ports published on loopback only; the administrator's password is this machine's own"
# The storage group: three members, one leader, as `spillctl storage status` shows them.
group_ok=""
for _ in $(seq 1 60); do
    if ctl --tls-ca "$root/deploy/certs/client-ca.pem" --output json storage status \
        >"$out/compose-test-group.json" 2>&1 \
        && python3 - "$out/compose-test-group.json" <<'PY'
import json, sys
g = json.load(open(sys.argv[1]))
roles = sorted(m["role"] for m in g["members"])
sys.exit(0 if g.get("leader") and roles == ["follower", "follower", "leader"] else 1)
PY
    then
        group_ok=1
        break
    fi
    sleep 1
done
[[ -n "$group_ok" ]] || { cat "$out/compose-test-group.json" >&2; die "the storage group is not three members with a leader"; }
echo "compose-test: storage group of three, leader $(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["leader"])' "$out/compose-test-group.json")"
compose --profile test up --exit-code-from loadgen --no-color >>"$log" 2>&1 || rc=$?
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
