#!/usr/bin/env bash
# Coverage-guided fuzzing of every parser of client input (docs/fuzzing.md):
# installs cargo-fuzz if it is missing, builds the targets under fuzz/ on the
# stable toolchain, then runs each for FUZZ_SECONDS (default 25). A crash
# fails the run and names the input that caused it.
#
#   scripts/fuzz.sh                          every target, 25 s each (`make test`)
#   FUZZ_SECONDS=600 scripts/fuzz.sh tables  one target, longer (`make fuzz`)
#
# Each target starts from fuzz/corpus-seeds/<target>/ and the crashes kept in
# fuzz/regressions/<target>/, and grows fuzz/corpus/<target>/ (not in git).
set -euo pipefail
cd "$(dirname "$0")/.."

CARGO_FUZZ_VERSION=0.13.2
seconds="${FUZZ_SECONDS:-25}"
all_targets=(frame_decoder handshake connection tables bodies http_api amqp1)
targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=("${all_targets[@]}")

if [[ "$(cargo fuzz --version 2>/dev/null || true)" != *"$CARGO_FUZZ_VERSION"* ]]; then
    echo "== installing cargo-fuzz $CARGO_FUZZ_VERSION"
    scripts/cargo.sh install --locked cargo-fuzz --version "$CARGO_FUZZ_VERSION"
fi

# No sanitizer: the code under test forbids `unsafe`, and without one
# cargo-fuzz needs no nightly flag, so the stable toolchain builds it. Debug
# assertions and overflow checks stay on.
fuzz_flags=(-O --debug-assertions --sanitizer none)

# The largest input per target: a few frames for the handshake, a whole
# session for the connection.
max_len() {
    case "$1" in
    frame_decoder) echo 8192 ;;
    handshake) echo 8192 ;;
    connection) echo 16384 ;;
    *) echo 4096 ;;
    esac
}

echo "== building the fuzz targets"
scripts/cargo.sh fuzz build "${fuzz_flags[@]}"

failed=()
for target in "${targets[@]}"; do
    corpora=("fuzz/corpus/$target" "fuzz/corpus-seeds/$target")
    [[ -d "fuzz/regressions/$target" ]] && corpora+=("fuzz/regressions/$target")
    mkdir -p "fuzz/corpus/$target"
    echo "== fuzzing $target for ${seconds}s"
    log="fuzz/target/$target.log"
    if scripts/cargo.sh fuzz run "${fuzz_flags[@]}" "$target" "${corpora[@]}" -- \
        -max_total_time="$seconds" -max_len="$(max_len "$target")" \
        -timeout=10 -rss_limit_mb=2048 -dict=fuzz/amqp.dict \
        -print_final_stats=1 >"$log" 2>&1; then
        grep -E "^stat::number_of_executed_units|^stat::new_units_added|^stat::peak_rss_mb" "$log" |
            sed "s/^/   $target /" || true
    else
        tail -n 60 "$log"
        echo "!! $target failed; full log in $log"
        ls fuzz/artifacts/"$target"/ 2>/dev/null | sed "s|^|!! reproducer: fuzz/artifacts/$target/|" || true
        echo "!! replay: scripts/cargo.sh fuzz run ${fuzz_flags[*]} $target fuzz/artifacts/$target/<file>"
        echo "!! keep it: fix the parser, move the file to fuzz/regressions/$target/"
        failed+=("$target")
    fi
done

if [[ ${#failed[@]} -gt 0 ]]; then
    echo "!! fuzzing found crashes in: ${failed[*]}"
    exit 1
fi
echo "== fuzzing: no crash in ${targets[*]} (${seconds}s each)"
