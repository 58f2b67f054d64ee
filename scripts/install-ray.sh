#!/usr/bin/env bash
# Installs the Ray integration's Python side into a venv in a cache directory keyed on the
# pinned versions (never into the repo), so a second run downloads nothing:
#   ray (PyPI, the version the reference Dressage pins) and pytest, then
#   `integrations/ray` from this checkout (reinstalled on every run: it is the code under test).
# Prints the venv's directory on stdout; its `bin/python -m pytest integrations/ray/tests` runs
# the tests, and `tests/tests/ray.rs` finds it through $AGENTBOX_RAY_VENV or this script.
# With --print-dir it only prints where that directory is (installed or not): no network.
set -euo pipefail

PINNED=(
  "ray==2.55.1"
  "pytest==8.3.4"
)

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/cache-dir.sh
. "$here/scripts/cache-dir.sh"
root="${AGENTBOX_RAY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/agentbox/ray}"
cache_dir "$root" "${1:-}" "$(python3 -c 'import sys; print(sys.version_info[:2])')" "${PINNED[@]}"

if [ ! -f "$dir/.complete" ]; then
  # A venv is not relocatable (its scripts carry its absolute path): build it in place and
  # mark it complete last; a partial one is wiped and rebuilt.
  mkdir -p "$root"
  rm -rf "$dir"
  python3 -m venv "$dir" >&2
  "$dir/bin/pip" install --quiet --disable-pip-version-check "${PINNED[@]}" >&2
  [ -x "$dir/bin/ray" ] || { echo "install-ray: ray missing after install" >&2; exit 1; }
  touch "$dir/.complete"
fi

# The package itself is cheap and is what changes: reinstall it from this checkout, without
# touching the pinned dependencies.
"$dir/bin/pip" install --quiet --disable-pip-version-check --no-deps --force-reinstall \
  "$here/integrations/ray" >&2
"$dir/bin/python" -c "import ray, agentbox_ray" \
  || { echo "install-ray: ray or agentbox_ray does not import" >&2; exit 1; }
echo "$dir"
