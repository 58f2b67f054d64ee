#!/usr/bin/env bash
# The README's main command: builds agentbox (the CLI and the three daemons it starts) and runs
# `agentbox demo` with any arguments given here. Run it as root (the launcher builds the
# sandboxes as root). AGENTBOX_DEMO_PROFILE picks the cargo profile (default release; the
# acceptance test, tests/tests/cli_demo.rs, uses dev, which its own build already made).
set -euo pipefail
cd "$(dirname "$0")/.."
profile="${AGENTBOX_DEMO_PROFILE:-release}"
# Every binary of the workspace, as the tests build them: one feature set, so nothing is
# rebuilt for a different one.
cargo build --quiet --profile "$profile" --workspace --bins
case "$profile" in
  dev) dir=debug ;;
  *) dir="$profile" ;;
esac
exec "${CARGO_TARGET_DIR:-target}/$dir/agentbox" demo "$@"
