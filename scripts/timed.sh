#!/usr/bin/env bash
# Runs one stage of `make test` and records its wall time, so a slow stage is
# visible in every run (CI included):
#
#   scripts/timed.sh STAGE command args...   run it, print and record the time
#   scripts/timed.sh --reset                 forget earlier records
#   scripts/timed.sh --summary               print every recorded stage
#
# Records go to target/stage-times.tsv (stage, seconds, ok|failed).
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
record="$root/target/stage-times.tsv"

case "${1:-}" in
--reset)
    mkdir -p "$(dirname "$record")"
    : >"$record"
    exit 0
    ;;
--summary)
    [[ -s "$record" ]] || exit 0
    total=0
    echo "== make test: wall time per stage"
    while IFS=$'\t' read -r stage seconds outcome; do
        printf '   %-16s %6d s  %s\n' "$stage" "$seconds" "$outcome"
        total=$((total + seconds))
    done <"$record"
    printf '   %-16s %6d s\n' "total" "$total"
    exit 0
    ;;
"" | -*)
    echo "usage: $0 STAGE command args... | --reset | --summary" >&2
    exit 2
    ;;
esac

stage="$1"
shift
start=$SECONDS
"$@"
rc=$?
seconds=$((SECONDS - start))
outcome=ok
[[ $rc -eq 0 ]] || outcome="failed ($rc)"
mkdir -p "$(dirname "$record")"
printf '%s\t%s\t%s\n' "$stage" "$seconds" "$outcome" >>"$record"
echo "== stage $stage: ${seconds} s, $outcome"
exit $rc
