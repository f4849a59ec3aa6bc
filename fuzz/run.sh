#!/usr/bin/env bash
# Runs every fuzz target for the given time (seconds, default 600), two at a time,
# starting from the committed seeds (fuzz/seeds/<target>/); new inputs go to
# fuzz/corpus/<target>/ (not committed), crashes to fuzz/artifacts/<target>/.
#   cargo install cargo-fuzz; fuzz/run.sh 600
set -euo pipefail
cd "$(dirname "$0")"
secs="${1:-600}"
targets=(policy should_allow should_rate_limit lease)
cargo +nightly fuzz build -O 2>&1 | tail -1
run() {
    local t="$1"
    mkdir -p "corpus/$t"
    cargo +nightly fuzz run -O "$t" "corpus/$t" "seeds/$t" -- \
        -max_total_time="$secs" -rss_limit_mb=4096 -print_final_stats=1 \
        > "logs/$t.log" 2>&1 && echo "$t: ok ($(grep -m1 -o 'stat::number_of_executed_units: *[0-9]*' "logs/$t.log" | grep -o '[0-9]*$') runs)" \
        || { echo "$t: FAILED, see fuzz/logs/$t.log"; return 1; }
}
mkdir -p logs
status=0
for ((i = 0; i < ${#targets[@]}; i += 2)); do
    run "${targets[i]}" & a=$!
    if ((i + 1 < ${#targets[@]})); then run "${targets[i + 1]}" & b=$!; else b=; fi
    wait "$a" || status=1
    if [ -n "$b" ]; then wait "$b" || status=1; fi
done
exit "$status"
