#!/usr/bin/env bash
# The test command (README "Quick start"; `.ci/run` calls exactly this). On a fresh machine of
# this kind it installs what the tests need, then runs every gate and every test:
#   - bubblewrap from Debian (the sandbox; later issues test against it for real),
#   - the pinned real agent CLIs from npm into a cache dir (scripts/install-clients.sh),
#   - cargo-nextest if the toolchain lacks it,
#   - the pinned ray and pytest in a venv cache dir, with integrations/ray (scripts/install-ray.sh),
# then fmt, clippy (warnings are errors), the Ray integration's Python tests, the nextest suite
# (whose tests/ray.rs uses that venv) and the doc tests.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v bwrap >/dev/null || need_apt+=(bubblewrap)
command -v git >/dev/null || need_apt+=(git)
# systemd's tools (not systemd as PID 1): the packaging test runs sysusers, tmpfiles and
# systemd-analyze against a temp root.
command -v systemd-analyze >/dev/null || need_apt+=(systemd)
command -v curl >/dev/null || need_apt+=(curl)
# The conformance suite's stand-in agent servers (a misbehaving opencode/openclaw) are Python.
command -v python3 >/dev/null || need_apt+=(python3)
# scripts/install-ray.sh makes a venv (Debian splits ensurepip out).
python3 -c 'import ensurepip' 2>/dev/null || need_apt+=(python3-venv)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "test.sh: missing ${need_apt[*]} and not root: install them first" >&2
    exit 1
  fi
  echo "test.sh: installing ${need_apt[*]} from Debian" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

if ! cargo nextest --version >/dev/null 2>&1; then
  cargo install --locked cargo-nextest
fi

AGENTBOX_CLIENTS_DIR=$(scripts/install-clients.sh)
export AGENTBOX_CLIENTS_DIR
echo "test.sh: agent CLIs in $AGENTBOX_CLIENTS_DIR" >&2

AGENTBOX_RAY_VENV=$(scripts/install-ray.sh)
export AGENTBOX_RAY_VENV
echo "test.sh: ray venv in $AGENTBOX_RAY_VENV" >&2

cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
# The Ray manager's rules, the pool client, a real two-node Ray cluster (tests/tests/ray.rs
# runs the two-pool test under nextest).
"$AGENTBOX_RAY_VENV/bin/python" -m pytest -q -p no:cacheprovider integrations/ray/tests -k 'not two_nodes'
cargo nextest run --workspace --locked --no-fail-fast "$@"
cargo test --workspace --doc --locked
# The fuzz targets' smoke (fuzz/README.md): every target built and run briefly from its corpus.
scripts/fuzz-smoke.sh
