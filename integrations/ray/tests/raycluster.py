"""A local multi-node Ray cluster for the tests: a head and further raylets on this machine,
each started by ``ray start`` in its own environment (so each has its own
``AGENTBOX_POOL_SOCKET``), stopped with ``ray stop --force`` at the end."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional

RAY = os.path.join(os.path.dirname(sys.executable), "ray")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalCluster:
    def __init__(self) -> None:
        self.address: Optional[str] = None
        self.started: List[List[str]] = []

    def _ray(self, args: List[str], env: Dict[str, str]) -> None:
        full = dict(os.environ)
        full.update(env)
        full.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        proc = subprocess.run([RAY, *args], env=full, capture_output=True, text=True,
                              timeout=180)
        if proc.returncode != 0:
            raise RuntimeError(f"ray {' '.join(args)} failed ({proc.returncode}):\n"
                               f"{proc.stdout}\n{proc.stderr}")
        self.started.append(args)

    def start_head(self, resources: Dict[str, float], env: Dict[str, str]) -> str:
        port = free_port()
        self._ray(["start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
                   "--num-cpus", "1", "--resources", json.dumps(resources),
                   "--include-dashboard", "false", "--disable-usage-stats"], env)
        self.address = f"127.0.0.1:{port}"
        return self.address

    def add_node(self, resources: Dict[str, float], env: Dict[str, str]) -> None:
        assert self.address is not None, "start_head first"
        self._ray(["start", "--address", self.address, "--node-ip-address", "127.0.0.1",
                   "--num-cpus", "1", "--resources", json.dumps(resources),
                   "--disable-usage-stats"], env)

    def wait_nodes(self, ray_module, count: int, timeout: float = 60.0) -> list:
        deadline = time.monotonic() + timeout
        while True:
            alive = [n for n in ray_module.nodes() if n.get("Alive")]
            if len(alive) >= count:
                return alive
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(alive)}/{count} Ray nodes alive: {alive}")
            time.sleep(0.5)

    def stop(self) -> None:
        subprocess.run([RAY, "stop", "--force"], capture_output=True, text=True, timeout=120)


def raylet_pids() -> List[int]:
    """Ray processes still running (to prove the cluster is gone)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ")
        except OSError:
            continue
        if b"/ray/core/src/ray/raylet/raylet" in cmd or b"gcs_server" in cmd:
            pids.append(int(entry))
    return pids
