#!/usr/bin/env bash
# Installs what building and testing Spillway needs beyond the Rust toolchain,
# on Debian/Ubuntu. Idempotent: does nothing (not even `apt-get update`) when
# everything is already there.
#
#   libclang-dev      RocksDB's bindings are generated with bindgen
#   g++               RocksDB's C++
#   protobuf-compiler only for the test that checks the checked-in gRPC code
#   python3-venv      the pika/kombu interop tests run in a venv
#   sccache           optional compiler cache (C++ and Rust); builds work without it
#
# With `--test` it also installs chromium and chromium-driver: the web
# console's tests drive a headless Chromium (tests/python/test_console.py,
# scripts/bench-console.py); `make run` does not need them.
#
# With `--bench` it also installs rabbitmq-server, which `make bench` runs
# beside Spillway for comparison (on its own port, started and stopped there).
set -euo pipefail

wanted=()
dpkg -s libclang-dev >/dev/null 2>&1 || wanted+=(libclang-dev)
command -v g++ >/dev/null 2>&1 || wanted+=(g++)
command -v protoc >/dev/null 2>&1 || wanted+=(protobuf-compiler)
python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || wanted+=(python3-venv)
command -v sccache >/dev/null 2>&1 || wanted+=(sccache)
if [[ "${1:-}" == "--test" || "${1:-}" == "--bench" ]]; then
    command -v chromium >/dev/null 2>&1 || wanted+=(chromium)
    command -v chromedriver >/dev/null 2>&1 || wanted+=(chromium-driver)
fi
if [[ "${1:-}" == "--bench" ]]; then
    [[ -x /usr/sbin/rabbitmq-server || -x /usr/lib/rabbitmq/bin/rabbitmq-server ]] || wanted+=(rabbitmq-server)
fi

if [[ ${#wanted[@]} -eq 0 ]]; then
    exit 0
fi

echo "install-deps: installing ${wanted[*]}"
sudo=""
if [[ $(id -u) -ne 0 ]]; then
    sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
# sccache is an optimisation: a mirror without it must not fail the install.
required=()
for package in "${wanted[@]}"; do
    [[ "$package" == sccache ]] || required+=("$package")
done
if [[ ${#required[@]} -gt 0 ]]; then
    $sudo apt-get install -y -qq --no-install-recommends "${required[@]}" >/dev/null
fi
if [[ " ${wanted[*]} " == *" sccache "* ]]; then
    $sudo apt-get install -y -qq --no-install-recommends sccache >/dev/null 2>&1 \
        || echo "install-deps: sccache not available, building without a cache"
fi
# The Debian package starts a RabbitMQ on 5672 where it can; the bench runs
# its own on another port, so stop the packaged one if it came up.
if [[ " ${wanted[*]} " == *" rabbitmq-server "* ]]; then
    $sudo service rabbitmq-server stop >/dev/null 2>&1 || true
fi
