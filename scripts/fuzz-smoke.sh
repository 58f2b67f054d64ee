#!/usr/bin/env bash
# CI smoke of the fuzz targets (fuzz/README.md): installs cargo-fuzz if missing, builds every
# target, then runs each for FUZZ_SECONDS (default 20) from its committed corpus. New inputs go
# to a scratch directory, so the tree stays clean; a crash fails the script and leaves its input
# in fuzz/artifacts/<target>/ (add it to fuzz/corpus/<target>/ with the fix and a regression
# test in the crate's own tests).
#
# Toolchain: the workspace's stable toolchain with RUSTC_BOOTSTRAP=1, which lets cargo-fuzz pass
# its -Z flags (-Zsanitizer=address: stable's rust-std ships the ASan runtime), so no nightly is
# needed. FUZZ_TOOLCHAIN=nightly uses a rustup nightly instead; FUZZ_SANITIZER=none drops ASan.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"

secs=${FUZZ_SECONDS:-20}
sanitizer=${FUZZ_SANITIZER:-address}
toolchain=()
[ -n "${FUZZ_TOOLCHAIN:-}" ] && toolchain=("+$FUZZ_TOOLCHAIN")
export RUSTC_BOOTSTRAP=1 CARGO_INCREMENTAL=0

if ! cargo fuzz --version >/dev/null 2>&1; then
  cargo install --locked cargo-fuzz
fi

start=$(date +%s)
cargo "${toolchain[@]}" fuzz build -O --sanitizer "$sanitizer"
echo "fuzz-smoke: built in $(($(date +%s) - start)) s" >&2

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
# Listed first, so a failing `cargo fuzz list` stops the script (a failure inside `$(...)` in a
# `for` list would not) and an empty list is an error, not a smoke that ran nothing.
targets=$(cargo fuzz list)
[ -n "$targets" ] || { echo "fuzz-smoke: no fuzz targets listed" >&2; exit 1; }
for t in $targets; do
  mkdir -p "$scratch/$t"
  dirs=("$scratch/$t")
  [ -d "corpus/$t" ] && dirs+=("corpus/$t")
  echo "fuzz-smoke: $t for ${secs}s" >&2
  cargo "${toolchain[@]}" fuzz run -O --sanitizer "$sanitizer" "$t" "${dirs[@]}" -- \
    -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 2>"$scratch/$t.log" ||
    { tail -n 60 "$scratch/$t.log" >&2; echo "fuzz-smoke: $t FAILED" >&2; exit 1; }
  grep -E '^stat::number_of_executed_units|^stat::average_exec_per_sec' "$scratch/$t.log" |
    tr '\n' ' ' | sed "s/^/fuzz-smoke: $t /" >&2
  echo >&2
done
echo "fuzz-smoke: all targets ran; total $(($(date +%s) - start)) s" >&2
