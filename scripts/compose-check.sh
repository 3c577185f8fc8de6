#!/usr/bin/env bash
# Exits non-zero, with a message saying why, unless Docker and a Compose work here.
set -euo pipefail
source "$(dirname "$0")/compose-common.sh"
docker_check
echo "docker-check: $(docker version --format 'Docker {{.Server.Version}}' 2>/dev/null), ${COMPOSE[*]}"
