"""A real two-node Ray cluster on this machine, without pools: the nodes show their slot
resources, the manager is found under the reference's name and namespace, one node actor is
pinned to each node and reads that raylet's own ``AGENTBOX_POOL_SOCKET``, and a pool socket
that does not answer makes its node lost (the manager keeps working)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest
from raycluster import LocalCluster, raylet_pids

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster():
    tmp = tempfile.mkdtemp(prefix="agentbox-ray-")
    socks = {"a": os.path.join(tmp, "a.sock"), "b": os.path.join(tmp, "b.sock")}
    c = LocalCluster()
    try:
        c.start_head({"agentbox_slots": 4}, {"AGENTBOX_POOL_SOCKET": socks["a"]})
        # The second node advertises the reference's resource name: both are accepted.
        c.add_node({"local_bwrap_slots": 4, "node_b": 1}, {"AGENTBOX_POOL_SOCKET": socks["b"]})
        ray.init(address=c.address, namespace="dressage", log_to_driver=False)
        c.wait_nodes(ray, 2)
        yield c, socks
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.stop()
        assert raylet_pids() == [], "ray processes left running"


def test_cluster_actors_pinned_per_node_and_unanswering_pools_lost(cluster):
    from agentbox_ray import manager as m

    c, socks = cluster
    nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 2
    b_id = next(i for i, n in nodes.items() if n["Resources"].get("node_b"))
    a_id = next(i for i in nodes if i != b_id)
    assert nodes[a_id]["Resources"]["agentbox_slots"] == 4
    assert nodes[b_id]["Resources"]["local_bwrap_slots"] == 4

    mgr = m.create_manager(pool_mode="blackbox")
    assert ray.get(ray.get_actor("dressage_local_bwrap_manager", namespace="dressage")
                   .pool_mode.remote()) == "blackbox"
    st = ray.get(mgr.init_pool.remote(), timeout=120)
    assert {n["node_id"] for n in st["nodes"]} == {a_id, b_id}
    # No pool listens on either socket: both nodes are lost, with the reason.
    for n in st["nodes"]:
        assert n["alive"] is False and "PoolUnavailable" in n["last_error"], n
    assert st["total_capacity"] == 0

    ids = ray.get(mgr.node_actor_identities.remote(), timeout=60)
    assert ids[a_id]["ray_node_id"] == a_id and ids[a_id]["socket"] == socks["a"]
    assert ids[b_id]["ray_node_id"] == b_id and ids[b_id]["socket"] == socks["b"]
    for node_id in (a_id, b_id):
        name = "agentbox_pool_node_" + node_id[:20]
        assert ray.get_actor(name, namespace="dressage") is not None

    with pytest.raises(TimeoutError):
        ray.get(mgr.wait_ready.remote(0), timeout=60)

    out = ray.get(mgr.shutdown.remote(), timeout=60)
    assert out["closed"] and out["supervisor_actors_destroyed"] == {a_id: True, b_id: True}
    again = ray.get(mgr.shutdown.remote(), timeout=60)
    assert again["already_closed"]
    with pytest.raises(Exception, match="shut down"):
        ray.get(mgr.acquire.remote("traj"), timeout=60)
    ray.kill(mgr)


def _script(name, address, *args):
    env = dict(os.environ, DRESSAGE_RAY_ADDRESS=address,
               DRESSAGE_LOCAL_BWRAP_MANAGER_NAME="agentbox_scripts_test")
    exe = os.path.join(os.path.dirname(sys.executable), name)
    return subprocess.run([exe, *args], env=env, capture_output=True, text=True, timeout=300)


def test_start_status_stop_scripts(cluster):
    c, _ = cluster
    start = _script("agentbox-ray-start", c.address, "--timeout", "1")
    # No pool answers: the manager is up, every node lost, and start says so.
    assert start.returncode == 1, start
    assert "not every slot is ready" in start.stderr
    assert "PoolUnavailable" in start.stdout
    st = _script("agentbox-ray-status", c.address, "--json")
    assert st.returncode == 0, st
    doc = json.loads(st.stdout)
    assert doc["closed"] is False and len(doc["nodes"]) == 2
    assert all(not n["alive"] for n in doc["nodes"])
    stop = _script("agentbox-ray-stop", c.address, "--json")
    assert stop.returncode == 0, stop
    assert json.loads(stop.stdout)["closed"] is True
    gone = _script("agentbox-ray-status", c.address)
    assert gone.returncode == 1 and "no manager" in gone.stderr


def test_a_node_actor_still_starting_is_not_a_silent_pool(cluster):
    """The first status call of ``init_pool`` waits for the node actors it just created to
    start: with an RPC timeout shorter than a Ray worker's start, each node is still lost for
    the pool's own reason (its socket does not answer), not for ``health: timed out``."""
    from agentbox_ray import manager as m

    mgr = m.AgentboxClusterManagerActor.options(
        name=m.manager_name(), namespace=m.namespace(), lifetime="detached",
        get_if_exists=False,
        runtime_env={"env_vars": {"AGENTBOX_RAY_RPC_TIMEOUT_SEC": "0.3"}},
    ).remote(pool_mode="blackbox")
    try:
        st = ray.get(mgr.init_pool.remote(), timeout=120)
        assert len(st["nodes"]) == 2
        for n in st["nodes"]:
            assert n["alive"] is False and "PoolUnavailable" in n["last_error"], n
    finally:
        ray.get(mgr.shutdown.remote(), timeout=60)
        ray.kill(mgr)
