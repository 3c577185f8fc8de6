#!/usr/bin/env bash
# Builds spillway-base:local (deploy/make-base.sh) and spillway:local from the
# release binaries already in target/release. `make images` builds them first.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
for b in spillway spillway-loadgen; do
    [[ -x "target/release/$b" ]] || { echo "make-images: target/release/$b missing: build it first (make images)" >&2; exit 1; }
done
rm -rf deploy/context && mkdir -p deploy/context
cp target/release/spillway target/release/spillway-loadgen deploy/context/
deploy/make-base.sh
docker build -q -t spillway:local -f deploy/Dockerfile deploy/context >/dev/null
echo "make-images: built spillway:local"
# The secret and certificates docker-compose.yml mounts: made here once,
# never in the image.
deploy/cluster-secret.sh
deploy/make-certs.sh
deploy/admin-credentials.sh
