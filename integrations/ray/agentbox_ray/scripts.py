"""``agentbox-ray-start``, ``agentbox-ray-status``, ``agentbox-ray-stop``: bring the cluster
manager up on a running Ray cluster, show its slots, take it down (the reference's
``dressage-local-bwrap-{start,status,stop}``). Each connects with ``--address``, else
``DRESSAGE_RAY_ADDRESS``, else ``auto``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional

import ray

from . import manager as m


def _env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    return raw.strip().lower() not in ("0", "false", "no", "off")


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, ""))
    except ValueError:
        return default


def _parser(what: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"agentbox-ray-{what}")
    p.add_argument("--address", help="Ray address (default: $DRESSAGE_RAY_ADDRESS or auto)")
    p.add_argument("--json", action="store_true", help="print the status as JSON")
    return p


def _print_status(st: Dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(st, indent=2, sort_keys=True))
        return
    print(f"pool_mode={st['pool_mode']} closed={st['closed']} "
          f"capacity={st['total_capacity']} ready={st['total_ready']} "
          f"leased={st['total_leased']} resetting={st['total_resetting']} "
          f"restarting={st['total_restarting']} failed={st['total_failed']} "
          f"lost={st['total_lost']}")
    leases = st.get("leases", {})
    print("leases: " + " ".join(f"{k}={leases[k]}" for k in sorted(leases)))
    cols: List[str] = ["node_id", "node_ip", "alive", "draining", "capacity", "free", "leased",
                       "used", "failed", "lost", "last_error"]
    rows = [[str(n.get(c) if c != "node_id" else n[c][:20]) for c in cols]
            for n in st.get("nodes", [])]
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c)
              for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))


def _existing() -> Optional[Any]:
    try:
        return m.get_manager()
    except ValueError:
        return None


def start(argv: Optional[List[str]] = None) -> int:
    p = _parser("start")
    p.add_argument("--timeout", type=float,
                   default=float(_env_int("DRESSAGE_LOCAL_BWRAP_WAIT_READY_TIMEOUT_SEC", 600)),
                   help="seconds to wait for every slot to be ready")
    args = p.parse_args(argv)
    mode = m.normalize_pool_mode(os.environ.get("DRESSAGE_LOCAL_BWRAP_POOL_MODE"))
    m.connect(args.address)
    mgr = _existing()
    if mgr is not None:
        try:
            their_mode = ray.get(mgr.pool_mode.remote(), timeout=30)
            closed = ray.get(mgr.status.remote(), timeout=60)["closed"]
        except Exception as err:  # noqa: BLE001 - unreachable: replaced below
            print(f"agentbox-ray-start: replacing an unreachable manager: {err}",
                  file=sys.stderr)
            their_mode, closed = None, True
        if their_mode is not None and their_mode != mode:
            raise SystemExit(f"a manager with pool_mode={their_mode!r} is running; "
                             "stop it first (agentbox-ray-stop)")
        if closed:
            ray.kill(mgr, no_restart=True)
            mgr = None
    if mgr is None:
        mgr = m.create_manager(
            total_servers=_env_int("DRESSAGE_LOCAL_BWRAP_TOTAL_SERVERS", 512),
            base_port=_env_int("DRESSAGE_LOCAL_BWRAP_BASE_PORT", 31000),
            pool_mode=mode)
    st = ray.get(mgr.init_pool.remote())
    if not st["nodes"]:
        print("agentbox-ray-start: no alive Ray node has an agentbox_slots resource "
              "(ray start --resources '{\"agentbox_slots\": N}')", file=sys.stderr)
        return 1
    try:
        st = ray.get(mgr.wait_ready.remote(args.timeout))
    except (TimeoutError, ray.exceptions.RayTaskError) as err:
        if not isinstance(err, TimeoutError) and not isinstance(
                getattr(err, "cause", None), TimeoutError):
            raise
        _print_status(ray.get(mgr.status.remote()), args.json)
        print(f"agentbox-ray-start: not every slot is ready after {args.timeout:g}s "
              "(the manager keeps running; see last_error above)", file=sys.stderr)
        return 1
    _print_status(st, args.json)
    return 0


def status(argv: Optional[List[str]] = None) -> int:
    args = _parser("status").parse_args(argv)
    m.connect(args.address)
    mgr = _existing()
    if mgr is None:
        print(f"agentbox-ray-status: no manager {m.manager_name()!r} in namespace "
              f"{m.namespace()!r}", file=sys.stderr)
        return 1
    _print_status(ray.get(mgr.status.remote()), args.json)
    return 0


def stop(argv: Optional[List[str]] = None) -> int:
    args = _parser("stop").parse_args(argv)
    m.connect(args.address)
    mgr = _existing()
    if mgr is None:
        print("agentbox-ray-stop: no manager running", file=sys.stderr)
        return 0
    destroy = _env_bool("DRESSAGE_LOCAL_BWRAP_DESTROY_ACTORS_ON_STOP", True)
    try:
        result = ray.get(mgr.shutdown.remote(destroy_supervisors=destroy), timeout=120)
    finally:
        ray.kill(mgr, no_restart=True)
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        print(f"stopped: {len(result.get('nodes', {}))} node(s); the pools keep running")
    return 0


def main_start() -> None:
    sys.exit(start())


def main_status() -> None:
    sys.exit(status())


def main_stop() -> None:
    sys.exit(stop())
