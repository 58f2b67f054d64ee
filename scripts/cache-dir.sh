# Sourced by install-peers.sh and install-ray.sh: where a pinned install lives, and their one
# option. `cache_dir ROOT ARG KEY...` sets $dir to ROOT/<the first 16 hex digits of the
# SHA-256 of the KEYs, one a line>, so a change of any pinned version is a fresh directory;
# then ARG: none goes on, --print-dir prints $dir and exits (no network), anything else is a
# usage error.
cache_dir() {
  local root=$1 arg=$2
  shift 2
  dir="$root/$(printf '%s\n' "$@" | sha256sum | cut -c1-16)"
  case "$arg" in
    "") ;;
    --print-dir) echo "$dir"; exit 0 ;;
    *) echo "usage: $0 [--print-dir]" >&2; exit 2 ;;
  esac
}
