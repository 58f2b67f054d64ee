"""Ray, for real, with two real ``agentbox-pool`` daemons: a head and a second raylet on this
machine, each started in its own environment naming its own pool socket; 8 leases spread over
both nodes; stopping node A's pool marks its leases LOST within the health interval, and new
acquires land on node B.

The pools (each with its own launcher and gateway on its own data dir) are started by the Rust
integration test ``tests/tests/ray.rs``, which runs this file with:

* ``AGENTBOX_RAY_TEST_POOL_A`` / ``AGENTBOX_RAY_TEST_POOL_B``: the two ``pool.sock`` paths;
* ``AGENTBOX_RAY_TEST_POOL_A_PID``: pool A's pid (this test stops it with SIGTERM).

Without them the test is skipped (run it through ``cargo nextest run -p agentbox-tests -E
'binary(ray)'``).
"""

from __future__ import annotations

import os
import signal
import time
import urllib.error
import urllib.request

import pytest
from raycluster import LocalCluster, raylet_pids

from agentbox_ray.pool_client import PoolClient

POOL_A = os.environ.get("AGENTBOX_RAY_TEST_POOL_A")
POOL_B = os.environ.get("AGENTBOX_RAY_TEST_POOL_B")
PID_A = os.environ.get("AGENTBOX_RAY_TEST_POOL_A_PID")

pytestmark = pytest.mark.skipif(
    not (POOL_A and POOL_B and PID_A),
    reason="needs two running agentbox-pools: run through tests/tests/ray.rs",
)

HEALTH_INTERVAL_S = 1.0
RPC_TIMEOUT_S = 5.0
# Manager settings travel in the raylets' environments (the actors read their own).
MANAGER_ENV = {
    "AGENTBOX_RAY_HEALTH_INTERVAL_SEC": str(HEALTH_INTERVAL_S),
    "AGENTBOX_RAY_RPC_TIMEOUT_SEC": str(RPC_TIMEOUT_S),
    "AGENTBOX_RAY_ACQUIRE_TIMEOUT_SEC": "300",
}


def _health(url: str) -> int:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as err:
        return err.code


def test_two_nodes_leases_spread_and_node_loss():
    import ray

    from agentbox_ray import manager as m

    for sock in (POOL_A, POOL_B):
        assert PoolClient(sock, timeout=10).status()["capacity"] >= 4, sock
    cluster = LocalCluster()
    try:
        cluster.start_head({"agentbox_slots": 4}, {"AGENTBOX_POOL_SOCKET": POOL_A, **MANAGER_ENV})
        cluster.add_node({"agentbox_slots": 4, "node_b": 1},
                         {"AGENTBOX_POOL_SOCKET": POOL_B, **MANAGER_ENV})
        ray.init(address=cluster.address, namespace="dressage", log_to_driver=False)
        cluster.wait_nodes(ray, 2)
        nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
        b_id = next(i for i, n in nodes.items() if n["Resources"].get("node_b"))
        a_id = next(i for i in nodes if i != b_id)

        mgr = m.create_manager(pool_mode="blackbox")
        ray.get(mgr.init_pool.remote(), timeout=300)
        ids = ray.get(mgr.node_actor_identities.remote(), timeout=60)
        assert ids[a_id]["socket"] == POOL_A and ids[a_id]["ray_node_id"] == a_id
        assert ids[b_id]["socket"] == POOL_B and ids[b_id]["ray_node_id"] == b_id
        st = ray.get(mgr.wait_ready.remote(600), timeout=660)
        assert st["total_ready"] >= 8, st

        # 8 leases at once: 4 per node (least used/capacity first).
        trajs = [f"traj-{i}" for i in range(8)]
        leases = ray.get([mgr.acquire.remote(t) for t in trajs], timeout=600)
        by_node = {}
        for lease in leases:
            assert lease["status"] == "ACTIVE" and lease["ready"] is True
            by_node.setdefault(lease["node_id"], []).append(lease)
        assert sorted(by_node) == sorted([a_id, b_id])
        assert len(by_node[a_id]) == 4 and len(by_node[b_id]) == 4
        assert len({lease["lease_id"] for lease in leases}) == 8
        assert len({lease["sandbox_url"] for lease in leases}) == 8

        # Acquiring again returns the same lease.
        assert ray.get(mgr.acquire.remote("traj-0"), timeout=60) == leases[0]

        # Each node's slot is served, and commands and files go through its pool.
        for node_id in (a_id, b_id):
            lease = by_node[node_id][0]
            assert _health(lease["sandbox_url"]) < 500
            t = lease["trajectory_id"]
            w = ray.get(mgr.write_file.remote(trajectory_id=t, path="note.txt",
                                              content=f"hello {node_id[:8]}"), timeout=120)
            assert w["bytes"] == len(f"hello {node_id[:8]}")
            text = ray.get(mgr.read_file.remote(trajectory_id=t, path="note.txt"), timeout=120)
            assert text == f"hello {node_id[:8]}"
            out = ray.get(mgr.run_command.remote(trajectory_id=t, command="cat note.txt"),
                          timeout=120)
            assert out["returncode"] == 0 and out["stdout"] == f"hello {node_id[:8]}"

        # Node A's pool stops: its leases become LOST within the health interval (plus one
        # RPC timeout); the bound below is only a hang guard.
        stopped = time.monotonic()
        os.kill(int(PID_A), signal.SIGTERM)
        lost_trajs = {lease["trajectory_id"] for lease in by_node[a_id]}
        while True:
            st = ray.get(mgr.status.remote(), timeout=60)
            node_a = next(n for n in st["nodes"] if n["node_id"] == a_id)
            if not node_a["alive"] and st["leases"]["lost"] == 4:
                break
            assert time.monotonic() - stopped < 120, st
            time.sleep(0.2)
        print(f"node A lost after {time.monotonic() - stopped:.1f}s: {node_a['last_error']}")
        node_b = next(n for n in st["nodes"] if n["node_id"] == b_id)
        assert node_b["alive"] and node_b["leased"] == 4
        for t in lost_trajs:
            with pytest.raises(KeyError):
                ray.get(mgr.run_command.remote(trajectory_id=t, command="true"), timeout=60)

        # Two of B's leases end; two lost trajectories acquire again and land on B once the
        # released slots have been reset.
        for lease in by_node[b_id][:2]:
            r = ray.get(mgr.release.remote(trajectory_id=lease["trajectory_id"],
                                           lease_id=lease["lease_id"],
                                           reason="paddock_terminate"), timeout=60)
            assert r["release_queued"] is True
        again = ray.get([mgr.acquire.remote(t) for t in sorted(lost_trajs)[:2]], timeout=600)
        for lease in again:
            assert lease["node_id"] == b_id and lease["status"] == "ACTIVE"
        assert {lease["lease_id"] for lease in again}.isdisjoint(
            {lease["lease_id"] for lease in leases})

        out = ray.get(mgr.shutdown.remote(), timeout=120)
        assert out["closed"]
        ray.kill(mgr)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.stop()
    assert raylet_pids() == [], "ray processes left running"
