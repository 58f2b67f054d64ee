#!/usr/bin/env bash
# Installs the peers `bench peers` compares the bridge with, at pinned versions, into a cache
# directory keyed on those versions (never into the repo), so a second run installs nothing:
#   LiteLLM (`litellm[proxy]`, PyPI) in a venv: <dir>/litellm/bin/litellm
#   @musistudio/llms and @musistudio/claude-code-router (npm): <dir>/node/node_modules/...
# Prints the directory on stdout. `bench peers` looks there (or in $AGENTBOX_PEERS_DIR).
# With --print-dir it only prints where that directory is (installed or not): no network.
set -euo pipefail

LITELLM="litellm[proxy]==1.108.7"
NPM_PEERS=(
  "@musistudio/llms@1.0.53"
  "@musistudio/claude-code-router@2.0.0"
)

# shellcheck source=scripts/cache-dir.sh
. "$(dirname "${BASH_SOURCE[0]}")/cache-dir.sh"
root="${AGENTBOX_PEERS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/agentbox/peers}"
cache_dir "$root" "${1:-}" "$LITELLM" "${NPM_PEERS[@]}"

if [ -f "$dir/.complete" ]; then
  echo "$dir"
  exit 0
fi

# Each half is marked complete when whole, so an interrupted install never looks complete and
# a half that succeeded is not downloaded again.
mkdir -p "$dir"
stage=""
trap 'if [ -n "$stage" ]; then rm -rf "$stage"; fi' EXIT

if [ ! -f "$dir/litellm/.complete" ]; then
  # A venv is not relocatable (its scripts carry its absolute path): build it in place and
  # mark it complete last; a partial one is wiped and rebuilt.
  rm -rf "$dir/litellm"
  python3 -m venv "$dir/litellm" >&2
  "$dir/litellm/bin/pip" install --quiet --disable-pip-version-check "$LITELLM" >&2
  [ -x "$dir/litellm/bin/litellm" ] \
    || { echo "install-peers: litellm missing after install" >&2; exit 1; }
  touch "$dir/litellm/.complete"
fi

if [ ! -f "$dir/node/.complete" ]; then
  stage=$(mktemp -d "$dir/.stage.XXXXXX")
  (
    cd "$stage"
    echo '{"name":"agentbox-peers","private":true}' > package.json
    npm install --no-audit --no-fund --save-exact --loglevel=error "${NPM_PEERS[@]}" >&2
  )
  [ -f "$stage/node_modules/@musistudio/llms/package.json" ] \
    || { echo "install-peers: @musistudio/llms missing after install" >&2; exit 1; }
  [ -f "$stage/node_modules/@musistudio/claude-code-router/package.json" ] \
    || { echo "install-peers: claude-code-router missing after install" >&2; exit 1; }
  touch "$stage/.complete"
  rm -rf "$dir/node"
  mv "$stage" "$dir/node"
  stage=""
fi

LITELLM_LOCAL_MODEL_COST_MAP=True "$dir/litellm/bin/python3" -c "import litellm" \
  || { echo "install-peers: litellm does not import" >&2; exit 1; }
touch "$dir/.complete"
echo "$dir"
