"""In-memory nodes for the manager's unit tests: a pool of slots with the real pool's
semantics that matter to the manager (lease ids, NoFreeSlot, Draining, a release that can be
held open, a node that can be made to fail), and a call log."""

from __future__ import annotations

import asyncio
import base64
import itertools
from typing import Any, Dict, List, Optional, Tuple

from agentbox_ray.pool_client import Draining, LeaseNotFound, NoFreeSlot, PoolUnavailable

_ids = itertools.count(1)


class FakeNode:
    def __init__(self, node_id: str, capacity: int, ip: str = "10.0.0.1"):
        self.node_id = node_id
        self.ip = ip
        self.capacity = capacity
        # slot -> (lease_id, trajectory_id) or None
        self.slots: Dict[int, Optional[Tuple[str, str]]] = {i: None for i in range(capacity)}
        self.generation = {i: 1 for i in range(capacity)}
        self.resetting: set = set()
        self.calls: List[Tuple[str, Any]] = []
        self.down = False  # every call raises PoolUnavailable
        self.hang = False  # every call hangs (timeouts)
        self.draining = False
        self.release_gate: Optional[asyncio.Event] = None  # held open until set
        self.files: Dict[str, bytes] = {}
        self.acquire_error: Optional[Exception] = None  # raised by every acquire
        self.release_error: Optional[Exception] = None  # raised by every release

    async def _enter(self, name: str, arg: Any = None) -> None:
        self.calls.append((name, arg))
        if self.hang:
            await asyncio.sleep(3600)
        if self.down:
            raise PoolUnavailable(f"{self.node_id}: connection refused")

    def count(self, name: str) -> int:
        return sum(1 for n, _ in self.calls if n == name)

    def ready(self) -> int:
        return sum(1 for i, s in self.slots.items() if s is None and i not in self.resetting)

    def finish_resets(self) -> None:
        for i in list(self.resetting):
            self.generation[i] += 1
        self.resetting.clear()

    async def status(self) -> Dict[str, Any]:
        await self._enter("status")
        leased = sum(1 for s in self.slots.values() if s is not None)
        return {
            "node_id": f"pool-{self.node_id}", "node_ip": self.ip, "hostname": self.node_id,
            "closed": False, "draining": self.draining, "capacity": self.capacity,
            "ready": self.ready(), "leased": leased, "releasing": len(self.resetting),
            "starting": 0, "restarting": 0, "failed": 0, "dead": 0, "lost": 0, "empty": 0,
            "last_error": None,
            "slots": [
                {"slot_id": i, "status": "LEASED" if s else "READY",
                 "generation": self.generation[i], "port": 31000 + i, "tid": None,
                 "lease_id": s[0] if s else None, "trajectory_id": s[1] if s else None,
                 "last_error": None}
                for i, s in self.slots.items()
            ],
        }

    async def acquire(self, trajectory_id, env_type, env_args):
        await self._enter("acquire", trajectory_id)
        if self.acquire_error is not None:
            raise self.acquire_error
        if self.draining:
            raise Draining("draining: no new leases", "draining", 409)
        for i, s in self.slots.items():
            if s is not None and s[1] == trajectory_id:
                return self._lease(i)
        for i, s in self.slots.items():
            if s is None and i not in self.resetting:
                lease_id = (f"lease-{self.node_id[:12]}-{i:04d}-gen{self.generation[i]}-"
                            f"{trajectory_id[:32]}-{next(_ids):08x}")
                self.slots[i] = (lease_id, trajectory_id)
                return self._lease(i)
        raise NoFreeSlot("no_free_slot: all slots busy", "no_free_slot", 503)

    def _lease(self, i: int) -> Dict[str, Any]:
        lease_id, traj = self.slots[i]
        return {"lease_id": lease_id, "trajectory_id": traj, "node_id": f"pool-{self.node_id}",
                "node_ip": self.ip, "slot_id": i, "port": 31000 + i,
                "sandbox_url": f"http://{self.ip}:{31000 + i}", "acquired_ts": 0.0,
                "deadline_ts": None, "generation": self.generation[i], "status": "ACTIVE",
                "ready": True}

    async def release(self, lease_id, trajectory_id, reason):
        await self._enter("release", (lease_id, trajectory_id, reason))
        if self.release_error is not None:
            raise self.release_error
        if self.release_gate is not None:
            await self.release_gate.wait()
        return self._release(lease_id)

    def _release(self, lease_id):
        for i, s in self.slots.items():
            if s is not None and s[0] == lease_id:
                self.slots[i] = None
                self.resetting.add(i)
                return {"released": True, "already_released": False, "release_queued": True,
                        "lease_id": lease_id, "slot_id": i}
        return {"released": True, "already_released": True, "lease_id": lease_id}

    async def force_release(self, slot_id, lease_id, reason):
        await self._enter("force_release", (slot_id, lease_id, reason))
        if self.release_error is not None:
            raise self.release_error
        return self._release(lease_id)

    def _slot_of(self, request) -> int:
        for i, s in self.slots.items():
            if s is not None and s[0] == request["lease_id"]:
                return i
        raise LeaseNotFound("lease_not_found", "lease_not_found", 404)

    async def run_command(self, request):
        await self._enter("run_command", request)
        i = self._slot_of(request)
        return {"cmd": request["command"], "stdout": f"slot {i}\n", "stderr": "",
                "returncode": 0, "timed_out": False, "lease_id": request["lease_id"],
                "trajectory_id": request["trajectory_id"], "slot_id": i,
                "node_id": self.node_id, "node_ip": self.ip}

    async def write_file(self, request):
        await self._enter("write_file", request)
        self._slot_of(request)
        data = request["content"]
        data = data.encode(request["encoding"]) if isinstance(data, str) else data
        self.files[request["path"]] = data
        return {"path": request["path"], "bytes": len(data), "append": False,
                "lease_id": request["lease_id"], "trajectory_id": request["trajectory_id"]}

    async def read_file(self, request):
        await self._enter("read_file", request)
        self._slot_of(request)
        data = self.files[request["path"]]
        return {"path": request["path"], "content_base64": base64.b64encode(data).decode(),
                "size": len(data), "truncated": False, "lease_id": request["lease_id"],
                "trajectory_id": request["trajectory_id"]}

    async def drain(self):
        await self._enter("drain")
        self.draining = True
        return await self.status()

    async def undrain(self):
        await self._enter("undrain")
        self.draining = False
        return await self.status()

    async def shutdown(self):
        await self._enter("shutdown")
        return {"node_id": self.node_id}


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now
