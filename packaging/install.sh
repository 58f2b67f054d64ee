#!/usr/bin/env bash
# Installs agentbox on this host (or into --destdir): the four binaries, the config, the
# systemd units, the users (sysusers) and the data dir (tmpfiles).
#
#   packaging/install.sh [--destdir DIR] [--prefix /usr/local] [--bin-dir DIR] [--start] [--rollouts]
#
# --rollouts is for a rollout host (a [pool] section): it also copies the pinned agent CLIs
# (scripts/install-clients.sh, cached) to /opt/agentbox/clients, the default
# `launcher.clients_dir`, and with --start enables agentbox-pool as well.
#
# --bin-dir uses already built binaries instead of `cargo build --release` (and of the static
# blackbox-server of scripts/build-blackbox-static.sh). Without --destdir it
# must run as root; it then creates the users and the data dir for real, reloads systemd when
# systemd is running, and with --start enables and starts the three services. An existing
# /etc/agentbox/agentbox.toml or *.env is never overwritten.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
top="$(dirname "$here")"
destdir="" prefix="/usr/local" bindir="" start=0 rollouts=0
while [ $# -gt 0 ]; do
  case "$1" in
    --destdir) destdir="$2"; shift 2 ;;
    --prefix) prefix="$2"; shift 2 ;;
    --bin-dir) bindir="$2"; shift 2 ;;
    --start) start=1; shift ;;
    --rollouts) rollouts=1; shift ;;
    *) echo "install.sh: unknown argument $1" >&2; exit 64 ;;
  esac
done
if [ -z "$destdir" ] && [ "$(id -u)" -ne 0 ]; then
  echo "install.sh: installing on this host needs root (or use --destdir)" >&2
  exit 77
fi

bins=(agentbox agentbox-launcher agentbox-gateway agentbox-bridge agentbox-pool blackbox-server)
if [ -z "$bindir" ]; then
  (cd "$top" && cargo build --release --locked -p agentbox-cli -p agentbox-launcher -p agentbox-gateway -p agentbox-bridge -p agentbox-pool -p agentbox-blackbox --bin blackbox-server)
  bindir="$top/target/release"
  # The rollout server statically linked (scripts/build-blackbox-static.sh says why).
  blackbox_bin="$("$top/scripts/build-blackbox-static.sh")"
fi
for b in "${bins[@]}"; do
  [ -x "$bindir/$b" ] || { echo "install.sh: $bindir/$b is missing" >&2; exit 1; }
done

root="${destdir%/}"
install -d -m 0755 "$root$prefix/bin" "$root/etc/systemd/system" "$root/usr/lib/sysusers.d" \
  "$root/usr/lib/tmpfiles.d" "$root/etc/agentbox" "$root$prefix/share/doc/agentbox"
for b in "${bins[@]}"; do
  install -m 0755 "$bindir/$b" "$root$prefix/bin/$b"
done
if [ -n "${blackbox_bin:-}" ]; then
  install -m 0755 "$blackbox_bin" "$root$prefix/bin/blackbox-server"
fi
for unit in "$here"/systemd/*.service; do
  sed "s|/usr/local/bin/|$prefix/bin/|g; s|/usr/local/share/|$prefix/share/|g" "$unit" \
    > "$root/etc/systemd/system/$(basename "$unit")"
  chmod 0644 "$root/etc/systemd/system/$(basename "$unit")"
done
install -m 0644 "$here/sysusers.d/agentbox.conf" "$root/usr/lib/sysusers.d/agentbox.conf"
install -m 0644 "$here/tmpfiles.d/agentbox.conf" "$root/usr/lib/tmpfiles.d/agentbox.conf"
install -m 0644 "$top/README.md" "$top/ARCHITECTURE.md" "$root$prefix/share/doc/agentbox/"
[ -e "$root/etc/agentbox/agentbox.toml" ] ||
  install -m 0644 "$here/agentbox.example.toml" "$root/etc/agentbox/agentbox.toml"
if [ ! -e "$root/etc/agentbox/bridge.env" ]; then
  umask 077
  printf '# The bridge token and the provider keys (the variables key_env names).\nAGENTBOX_BRIDGE_TOKEN=\nOPENAI_API_KEY=\nANTHROPIC_API_KEY=\n' \
    > "$root/etc/agentbox/bridge.env"
fi
if [ ! -e "$root/etc/agentbox/gateway.env" ]; then
  umask 077
  printf '# The bridge token, for remote models.\nAGENTBOX_BRIDGE_TOKEN=\n' > "$root/etc/agentbox/gateway.env"
fi

if [ "$rollouts" -eq 1 ]; then
  # A copy, not a link: the launcher opens clients_dir without following symlinks, and the
  # slots' agent uids must be able to read it (install-clients.sh leaves it 0755).
  clients=$("$top/scripts/install-clients.sh")
  install -d -m 0755 "$root/opt/agentbox"
  rm -rf "$root/opt/agentbox/clients.new"
  cp -a "$clients" "$root/opt/agentbox/clients.new"
  chown -R root:root "$root/opt/agentbox/clients.new"
  rm -rf "$root/opt/agentbox/clients"
  mv "$root/opt/agentbox/clients.new" "$root/opt/agentbox/clients"
fi

# Users, then the data dir (owners resolve against the users just created).
if [ -n "$root" ]; then
  install -d -m 0755 "$root/etc"
  for f in passwd group shadow gshadow; do [ -e "$root/etc/$f" ] || : > "$root/etc/$f"; done
  systemd-sysusers --root="$root" agentbox.conf
  systemd-tmpfiles --root="$root" --create agentbox.conf
else
  systemd-sysusers agentbox.conf
  systemd-tmpfiles --create agentbox.conf
  if [ -d /run/systemd/system ]; then
    systemctl daemon-reload
    if [ "$start" -eq 1 ]; then
      systemctl enable --now agentbox-launcher.service agentbox-bridge.service agentbox-gateway.service
      [ "$rollouts" -eq 0 ] || systemctl enable --now agentbox-pool.service
    fi
    [ "$rollouts" -eq 1 ] ||
      echo "install.sh: on a rollout host (a [pool] section), also: systemctl enable --now agentbox-pool.service (or install with --rollouts)" >&2
  else
    echo "install.sh: systemd is not running here; start the daemons by hand (see README)" >&2
  fi
fi
echo "install.sh: installed into ${root:-/} (binaries in $prefix/bin)"
