# Sourced by scripts/compose-*.sh: finds Docker and a Compose, names the run.
# Fails loudly (never passes silently) when Docker is not usable here.

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

die() {
    echo "$(basename "$0"): $*" >&2
    exit 1
}

docker_check() {
    command -v docker >/dev/null 2>&1 \
        || die "docker is not installed: the compose tests need Docker Engine and Compose (see docs/deploy.md)"
    docker info >/dev/null 2>&1 \
        || die "cannot reach the Docker daemon (is it running, may this user use it?): the compose tests need it"
    if docker compose version >/dev/null 2>&1; then
        COMPOSE=(docker compose)
    elif command -v docker-compose >/dev/null 2>&1; then
        COMPOSE=(docker-compose)
    else
        die "neither 'docker compose' nor 'docker-compose' is installed"
    fi
}

# A project name of its own per run, so runs never share containers or volumes,
# and host ports chosen by Docker so that nothing on 5671-5674/50051 is in the way.
compose_setup() {
    local kind="$1"
    PROJECT="${SPILLWAY_COMPOSE_PROJECT:-spillway-$kind-$(date +%s)-$$}"
    export SPILLWAY_AMQP_PORT="${SPILLWAY_AMQP_PORT:-0}"
    export SPILLWAY_AMQP_PORT2="${SPILLWAY_AMQP_PORT2:-0}"
    export SPILLWAY_MANAGEMENT_PORT="${SPILLWAY_MANAGEMENT_PORT:-0}"
    export SPILLWAY_AMQPS_PORT="${SPILLWAY_AMQPS_PORT:-0}"
    export SPILLWAY_AMQPS_PORT2="${SPILLWAY_AMQPS_PORT2:-0}"
    # The internal gRPC secret and the certificates docker-compose.yml mounts
    # (made once, kept; leaf certificates re-issued before they expire).
    "$root/deploy/cluster-secret.sh"
    "$root/deploy/make-certs.sh"
    "$root/deploy/admin-credentials.sh"
}

compose() {
    "${COMPOSE[@]}" -p "$PROJECT" -f "$root/docker-compose.yml" "$@"
}

# Always leaves nothing behind: containers, networks, volumes of this project.
compose_teardown() {
    local rc=$?
    set +e
    if [[ $rc -ne 0 ]]; then
        echo "--- $PROJECT failed (exit $rc): last logs ---" >&2
        compose --profile test --profile faults logs --no-color --tail=40 >&2 2>/dev/null
    fi
    compose --profile test --profile faults down -v --remove-orphans --timeout 5 >/dev/null 2>&1
    # Anything compose did not know about (a run that died half-way).
    docker ps -aq --filter "label=com.docker.compose.project=$PROJECT" | xargs -r docker rm -f >/dev/null 2>&1
    docker network ls -q --filter "label=com.docker.compose.project=$PROJECT" | xargs -r docker network rm >/dev/null 2>&1
    docker volume ls -q --filter "label=com.docker.compose.project=$PROJECT" | xargs -r docker volume rm >/dev/null 2>&1
    return $rc
}

# Container id of a service of this project.
cid() {
    docker ps -aq --filter "label=com.docker.compose.project=$PROJECT" \
        --filter "label=com.docker.compose.service=$1" | head -n1
}

health() {
    docker inspect -f '{{if .State.Health}}{{.State.Health.Status}}{{else}}{{.State.Status}}{{end}}' "$1" 2>/dev/null || echo gone
}

# Waits (up to $2 s) for a service's container to be healthy.
wait_healthy() {
    local service="$1" limit="${2:-120}" start=$SECONDS id
    while :; do
        id="$(cid "$service")"
        if [[ -n "$id" && "$(health "$id")" == healthy ]]; then
            return 0
        fi
        if (( SECONDS - start >= limit )); then
            die "$service not healthy after ${limit} s"
        fi
        sleep 1
    done
}
