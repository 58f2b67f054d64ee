"""agentbox's Ray integration: rollout slots of ``agentbox-pool`` hosts, leased across a Ray
cluster by a manager actor that speaks the reference (Dressage ``local_bwrap``) manager's
protocol.

* :mod:`agentbox_ray.pool_client`: one host's ``pool.sock`` (standard library only);
* :mod:`agentbox_ray.core`: the manager's rules, without Ray;
* :mod:`agentbox_ray.node_actor`, :mod:`agentbox_ray.manager`: the Ray actors;
* :mod:`agentbox_ray.scripts`: ``agentbox-ray-{start,status,stop}``.

Ray is imported only by the actor modules, so the client and the core work without it.
"""

__version__ = "0.1.0"
