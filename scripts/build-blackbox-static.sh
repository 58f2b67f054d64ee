#!/usr/bin/env bash
# Builds blackbox-server as a static-pie executable (glibc linked in, `-C target-feature=+crt-static`)
# and prints its path. This is the binary packaging/install.sh installs.
#
#   scripts/build-blackbox-static.sh
#
# Why: one server runs in every rollout slot, hundreds per host. Linked dynamically, an idle
# server keeps about 2 MB of libc, libm, ld.so and libgcc_s pages mapped; static, only the few
# hundred kB of libc it calls (BENCHMARKS.md, "blackbox-server: start to /health, idle
# memory"). glibc 2.34+ has its `files` and `dns` name services inside libc, so a static
# server still resolves names from /etc/hosts and DNS with no shared library in its sandbox.
# A separate target dir: crt-static needs `--target` (proc macros cannot be built static), and
# must not invalidate the dynamic build the tests use.
set -euo pipefail
top="$(cd "$(dirname "$0")/.." && pwd)"
triple="$(rustc -vV | sed -n 's/^host: //p')"
dir="$top/target/static"
(cd "$top" && RUSTFLAGS="-C target-feature=+crt-static" cargo build --release --locked --quiet \
  --target "$triple" --target-dir "$dir" -p agentbox-blackbox --bin blackbox-server) >&2
echo "$dir/$triple/release/blackbox-server"
