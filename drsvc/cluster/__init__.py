"""A site of several storage nodes: the controller that holds no pool, and the node side.

The site config lists the nodes (``[nodes.<name>]``). Each node runs a worker on its own
queue; :class:`ClusterController` answers the controller contract
(drsvc.controller_api.Controller) by placing volumes on nodes and sending every call that
touches a pool to the node holding the object, as a task (:class:`NodeCalls`, implemented
over Celery by workers.client.NodeDispatcher). On the node, :class:`NodeOps` runs the call
on the node's own pool with a :class:`drsvc.controller.PoolController`.

Routing needs no table: the ids a node hands out start with its name (``n1.vol-…``,
``n1.snap-…``). A client-chosen name is claimed for one node in the site's Redis before
the node creates anything, so a retried CreateVolume lands on the node that holds the
first attempt's volume, whatever capacity says by then.

Modules, one job each:

- ``controller``: ClusterController, the contract over the nodes (volumes, snapshots;
  groups and group snapshots handed to their modules);
- ``routing``: Router, the node an id names and the calls sent there (pages across nodes);
- ``names``: NameClaims, a name claimed for a node, made there, released on delete;
- ``placement``: Placement, the node for a new volume, and the site's capacity;
- ``groups``: ClusterGroups, volume groups kept in one part per node;
- ``group_snapshots``: ClusterGroupSnapshots, group snapshots cut in parts at one instant;
- ``replication``: ClusterReplication, the Replication RPCs on every part of a unit;
- ``node_ops``: NodeOps, the node side of every call (``drsvc.node`` task);
- ``wire``: the JSON codecs between the two sides; ``calls``: what the edge provides
  (NodeCalls, Barrier).
"""
from .calls import Barrier, NodeCalls
from .controller import ClusterController
from .node_ops import NODE_ONLY_OPS, NODE_OPS, NodeOps
from .replication import ClusterReplication, combine_info, settle_plan

__all__ = ["NODE_ONLY_OPS", "NODE_OPS", "Barrier", "ClusterController", "ClusterReplication", "NodeCalls",
           "NodeOps", "combine_info", "settle_plan"]
