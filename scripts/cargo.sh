#!/usr/bin/env bash
# Runs cargo with a compiler cache outside the checkout when sccache works:
# a fresh clone on the same machine (CI) then rebuilds RocksDB's C++ in under
# a minute instead of ten. Without sccache, plain cargo.
set -euo pipefail
if [[ -z "${RUSTC_WRAPPER:-}" ]] && command -v sccache >/dev/null 2>&1; then
    export SCCACHE_DIR="${SCCACHE_DIR:-/var/cache/spillway-sccache}"
    export SCCACHE_CACHE_SIZE="${SCCACHE_CACHE_SIZE:-10G}"
    if mkdir -p "$SCCACHE_DIR" 2>/dev/null && sccache --start-server >/dev/null 2>&1 || sccache --show-stats >/dev/null 2>&1; then
        export RUSTC_WRAPPER=sccache
    fi
fi
exec cargo "$@"
