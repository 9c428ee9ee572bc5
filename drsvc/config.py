"""Per-site configuration (TOML). One file describes one site and its peers.

Example::

    site = "a"
    node_id = "a-node1"
    pool = "/var/lib/drsvc/pool"
    endpoint = "unix:///run/drsvc/csi.sock"
    redis_url = "redis://127.0.0.1:6379/0"              # the password: env DRSVC_REDIS_PASSWORD
    metrics_port = 9101                                 # 0: no /metrics
    secrets_file = "/etc/drsvc/rpc-secret"              # optional: require secrets.token
    retention = "1x1h(keep=all) | 24x1h | 14x1d | 8x1w"  # recovery points kept at the peer (zrepl grid)
    visibility_timeout = 300                            # redeliver a dead worker's task after this
    bwlimit = "200mbit"                                 # all syncs of the site together (0: no cap), or
    #                                                   # by the hour: "100mbit 08:00-20:00 Mon-Fri, 1gbit"
    # timezone = "Europe/Berlin"                        # a bwlimit schedule's hours (default UTC)

    [peers.b]
    host = "10.0.0.2"
    port = 22
    user = "drsvc"
    known_hosts = "/etc/drsvc/peers/b.known_hosts"       # pinned host key
    key = "/etc/drsvc/keys/to-b"                         # dedicated private key
    # transport = "ssh"                                  # default; "local": pool = "/path" on this host
    # max_syncs = 1                                      # syncs to this peer at once (default: with
    #                                                    # several peers, all but one worker process)
    # bwlimit = "50mbit"                                 # syncs to this peer together, under the site's
    # link_rate = "1gbit"                                # the path's rate (bytes/s, or "100mbit", "1gbit")
    # connections = 2                                    # SSH connections a large sync's stripes spread over
    # max_stripes = 16                                   # channels one sync may take (1: never stripe)
    # window = 2097152                                   # the peer sshd's channel window (HPN-SSH: larger)
    # stripes = 0                                        # fix the channels of every sync (0: from RTT and rate)
    # ack = "durable"                                    # the peer answers a sync once its journal is durable,
    #                                                    # and applies after the answer (the undo copy too);
    #                                                    # "applied": once its replica is at the generation

A site of several storage nodes lists them; each node's plugin and worker run with
``--node NAME`` (or ``DRSVC_NODE``) and use that node's pool, and the site's controller
(``drsvc-csi --role controller``) holds no pool: it places volumes on nodes and sends
every pool operation to the node's queue ``drsvc.<site>.<node>``::

    [nodes.n1]
    pool = "/var/lib/drsvc/pool"      # the pool on that node (read by that node's processes)
    labels = { "topology.kubernetes.io/zone" = "rack1" }   # extra topology segments
    # peer_node = "n1"                # the peer site's node that holds its replicas (default:
    #                                 # the same name: node pairs)

and a multi-node peer names the sshd of each of its nodes (one known_hosts pins them all)::

    [peers.b.nodes.n1]
    host = "10.0.1.1"
    port = 22

A node name may be an FQDN, as Kubernetes node names often are; TOML then needs it quoted
(``[nodes."w1.dc1.example.com"]``). Its last label must not be ``control`` or ``api``.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import re
import time
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

from .errors import (ConfigInvalid, ConfigNotFound, DrsvcError, NodeNotFound, PeerNotFound, PeerRequired,
                     Unauthenticated, UnsupportedEndpoint)
from . import redis_url
from .ids import check_id
from .rate_schedule import RateSchedule, ScheduleInvalid, is_schedule, parse_schedule, zone
from .retention import check_grid
from .schedule import DEFAULT_VERIFY_INTERVAL, parse_verify_interval


# operations that move data (the data queue); every other operation is control
DATA_OPS = frozenset({"sync", "verify"})

# The keys each transport needs in its [peers.<name>] table (drsvc.replication.control.peers builds it).
TRANSPORT_KEYS = {"ssh": ("host", "known_hosts", "key"), "local": ("pool",)}
ACKS = ("applied", "durable")   # when a peer answers a commit ([peers.<name>] ack)


@dataclass(frozen=True)
class PeerConfig:
    """One [peers.<name>] table: how to reach the peer site (not the transport.Peer itself)."""
    name: str
    host: str = ""
    port: int = 22
    user: str = "root"
    known_hosts: Path | None = None
    key: Path | None = None
    transport: str = "ssh"
    pool: Path | None = None      # transport "local": the peer's pool on this host
    max_syncs: int = 0            # syncs to this peer at once, site-wide (0: the default rule)
    bwlimit: int = 0              # bytes per second for all syncs to this peer together (0: no cap)
    bwschedule: RateSchedule | None = None   # bwlimit by the hour (then bwlimit is its default)
    nodes: dict = field(default_factory=dict)   # a multi-node peer: node -> (host, port) of its sshd
    link_rate: float = 0.0        # bytes/s of the path (0: unknown); sizes a large sync's stripes
    connections: int = 2          # SSH connections the stripes of one sync spread over
    max_stripes: int = 16         # channels one sync may take
    window: int = 2 << 20         # the peer sshd's channel window
    stripes: int = 0              # channels of every sync, fixed (0: from the measured RTT and the rate)
    ack: str = "durable"          # the peer answers a commit once "durable" (its journal), or once "applied"

    def at_node(self, node: str, where: str) -> PeerConfig:
        """This peer as one node of ours reaches it: the sshd of the peer node that holds
        our node's replicas (a one-node peer: itself)."""
        if not self.nodes:
            return self
        if node not in self.nodes:
            raise ConfigInvalid(where=where, reason=f"peer {self.name} lists no node {node!r} "
                                                    f"(its nodes: {', '.join(sorted(self.nodes))})")
        host, port = self.nodes[node]
        return replace(self, host=host, port=port, nodes={})


@dataclass(frozen=True)
class NodeConfig:
    """One [nodes.<name>] table: a storage node of a multi-node site."""
    name: str
    pool: Path
    labels: dict = field(default_factory=dict)
    peer_node: str = ""

    @property
    def replica_node(self) -> str:
        """The peer site's node that holds this node's replicas (node pairs by name)."""
        return self.peer_node or self.name

    @property
    def pair(self) -> str:
        """The value of topology.drsvc.io/node this node advertises: the same at both nodes
        of a pair (its name, or both names sorted when the pair's names differ), so a PV
        made here is schedulable on the peer node that holds its replica."""
        return "-".join(sorted({self.name, self.replica_node}))


# queue suffixes a node name must not take: node "control" would take the site's control
# queue, and a node "n1.api" or "n1.control" node n1's api or control queue
RESERVED_NODE_NAMES = frozenset({"control", "api"})


@dataclass(frozen=True)
class SiteConfig:
    site: str
    node_id: str
    pool: Path
    endpoint: str
    redis_url: str
    peers: dict = field(default_factory=dict)
    metrics_port: int = 0
    secrets_file: Path | None = None
    path: Path | None = None
    # a task whose worker died is redelivered after this long (acks_late)
    visibility_timeout: int = 300
    zone: str = ""          # topology.drsvc.io/zone, the same at both sites (default: "a-b")
    nodes: dict = field(default_factory=dict)   # name -> NodeConfig (empty: a one-node site)
    node_call_timeout: float = 30.0   # the controller's wait for one node's answer
    retention: str = ""     # recovery points kept at the peer (a zrepl grid); "": drsvc.retention.DEFAULT_GRID
    bwlimit: int = 0        # bytes per second for all syncs of the site together (0: no cap)
    bwschedule: RateSchedule | None = None   # bwlimit by the hour (then bwlimit is its default)
    timezone: str = "UTC"   # the zone a bwlimit schedule's hours are read in
    verify_interval: int = DEFAULT_VERIFY_INTERVAL   # seconds between verifies of a replica held here (0: none)
    verify_read_rate: int = 0   # bytes per second a verify reads (0: no cap)
    verify_repair: bool = False   # a scheduled verify that finds mismatches asks for their repair

    @property
    def multinode(self) -> bool:
        return bool(self.nodes)

    def node_queue(self, node: str) -> str:
        """The queue of one storage node's worker: every operation on that node's pool."""
        if node not in self.nodes:
            raise NodeNotFound(site=self.site, node=node, names=", ".join(sorted(self.nodes)) or "none")
        return f"drsvc.{self.site}.{node}"

    def for_node(self, node: str) -> SiteConfig:
        """This config as node *node*'s processes read it: its name and its pool."""
        if node not in self.nodes:
            raise NodeNotFound(site=self.site, node=node, names=", ".join(sorted(self.nodes)) or "none")
        n = self.nodes[node]
        where = str(self.path or "site config")
        peers = {name: p.at_node(n.replica_node, f"{where} [peers.{name}]") for name, p in self.peers.items()}
        return replace(self, node_id=node, pool=n.pool, peers=peers)

    @property
    def is_node(self) -> bool:
        """This is one storage node's view of a multi-node site (load(..., node=))."""
        return self.node_id in self.nodes

    @property
    def scope(self) -> str:
        """What this process replicates: the site, or one node of it ("a", "a.n1")."""
        return f"{self.site}.{self.node_id}" if self.is_node else self.site

    @property
    def queue(self) -> str:
        """The data queue (syncs) of this site, or of this node of a multi-node site: a
        site's workers serve only their own site (and a node's, only its own node)."""
        return f"drsvc.{self.scope}"

    @property
    def control_queue(self) -> str:
        """The control queue (enable, disable, promote, demote, resync) of this site or node:
        served by a worker of its own, so an operator's or a controller's call never waits
        behind syncs."""
        return f"drsvc.{self.scope}.control"

    def api_queue(self, node: str) -> str:
        """A node's queue for its site controller's calls (drsvc.cluster.NodeOps): served by
        a thread-pool worker of the node that runs nothing else, so a call that waits for a
        control job of the node (a Demote) never waits on itself."""
        return f"{self.node_queue(node)}.api"

    def queue_for(self, op: str) -> str:
        """The queue a drsvc.<op> task goes to: syncs on the data queue, the rest on control."""
        return self.queue if op in DATA_OPS else self.control_queue

    def peer(self, name: str = "") -> PeerConfig:
        if not name:
            if len(self.peers) == 1:
                return next(iter(self.peers.values()))
            raise PeerRequired(site=self.site, count=len(self.peers), names=", ".join(sorted(self.peers)) or "none")
        try:
            return self.peers[name]
        except KeyError:
            raise PeerNotFound(site=self.site, name=name) from None

    def peer_sync_slots(self, peer: str, concurrency: int) -> int:
        """How many syncs to *peer* may run at once on this site (0: no cap).

        A peer's `max_syncs` sets it. Otherwise, with several peers, one peer may hold all
        but one of a worker's processes, so a slow peer never blocks syncs to the others;
        with one peer there is nothing to protect and no cap."""
        p = self.peers.get(peer)
        if p is not None and p.max_syncs:
            return p.max_syncs
        return max(1, concurrency - 1) if len(self.peers) > 1 else 0

    def cap_schedules(self, peer: str) -> dict[str, RateSchedule]:
        """The shared caps a sync to *peer* may be under, name -> its schedule, the peer's
        before the site's (a sync takes from each in this order); a cap that never caps
        anything is left out."""
        p = self.peers.get(peer)
        named = [(f"peer:{peer}", schedule_of(p)) if p is not None else ("", None), ("site", schedule_of(self))]
        return {name: sch for name, sch in named if sch is not None and sch.ever_capped}

    def bandwidth_caps(self, peer: str, at: float | None = None) -> dict[str, int]:
        """The caps in force at *at* (now) for a sync to *peer*, name -> bytes per second, in
        the order of cap_schedules; empty: no cap."""
        t = time.time() if at is None else at
        caps = {name: sch.rate_at(t) for name, sch in self.cap_schedules(peer).items()}
        return {name: rate for name, rate in caps.items() if rate}

    def check_secrets(self, secrets: dict) -> None:
        """When a secrets file is configured, RPCs must carry secrets['token'] matching it."""
        if self.secrets_file is None:
            return
        expected = self.secrets_file.read_text().strip().encode()
        given = secrets.get("token", "").encode()
        if not given or not hmac.compare_digest(hashlib.sha256(given).digest(),
                                                hashlib.sha256(expected).digest()):
            raise Unauthenticated("the request's secrets do not carry a valid token")


def schedule_of(holder) -> RateSchedule | None:
    if holder.bwschedule is not None:
        return holder.bwschedule
    return RateSchedule.constant(holder.bwlimit) if holder.bwlimit else None


def socket_path(endpoint: str) -> Path:
    """The unix socket path of a CSI endpoint (unix:///p, unix:/p or /p)."""
    for prefix in ("unix://", "unix:"):
        if endpoint.startswith(prefix):
            return Path(endpoint[len(prefix):])
    if endpoint.startswith("/"):
        return Path(endpoint)
    raise UnsupportedEndpoint(endpoint=endpoint)


# rate units: bits per second are decimal, as tc and link prices count them; bytes per second
# are binary. Matched lower-cased, so no unit may depend on its case ("Mb/s" vs "MB/s").
_RATE_UNITS = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8,
               "b/s": 1, "kib/s": 1 << 10, "mib/s": 1 << 20, "gib/s": 1 << 30}
_RATE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z/]*)\s*")
_UNITS = "bit, kbit, mbit, gbit (bits/s) or B/s, KiB/s, MiB/s, GiB/s"
MIN_BWLIMIT = 64_000        # 512 kbit


def parse_bwlimit(value, where: str, key: str = "bwlimit") -> int:
    """A bandwidth cap -> bytes per second (0: no cap). *value* is an integer (bytes per
    second) or a string: a number and a unit, bit/kbit/mbit/gbit (decimal bits per second)
    or B/s, KiB/s, MiB/s, GiB/s: ``"100mbit"``, ``"1gbit"``, ``"50MiB/s"``. A cap under
    512 kbit is refused: it is a unit left out (``100`` for ``"100mbit"``), not a link."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigInvalid(where=where, reason=f"{key} must be bytes per second (an integer) or a string "
                                                f"like \"100mbit\" or \"50MiB/s\", not {value!r}")
    rate = value if isinstance(value, int) else _rate_of(value, where, key)
    if rate < 0:
        raise ConfigInvalid(where=where, reason=f"{key} = {value!r} is negative; 0 means no cap")
    if 0 < rate < MIN_BWLIMIT:
        raise ConfigInvalid(where=where, reason=f"{key} = {value!r} is {rate} bytes/s, under the least cap "
                                                f"of 512 kbit (64000 bytes/s): was a unit left out? ({_UNITS})")
    return rate


def parse_cap(value, where: str, tz, key: str = "bwlimit") -> tuple[int, RateSchedule | None]:
    """A cap that may follow the clock (drsvc.rate_schedule): -> (the default rate, the
    schedule, or None for a plain rate). Each rate in a schedule is read as parse_bwlimit
    reads one."""
    if not isinstance(value, str) or not is_schedule(value):
        return parse_bwlimit(value, where, key), None
    def rate_of(text: str) -> int:
        try:
            return parse_bwlimit(text, where, key)
        except ConfigInvalid as e:
            raise ScheduleInvalid(f"rate {text!r}: {e.fields['reason']}") from None
    try:
        sch = parse_schedule(value, rate_of, tz)
    except ScheduleInvalid as e:
        raise ConfigInvalid(where=where, reason=f"{key} = {value!r}: {e}") from None
    return sch.default, sch


def _rate_of(text: str, where: str, key: str) -> int:
    m = _RATE.fullmatch(text.lower())
    if m is None or (m.group(2) and m.group(2) not in _RATE_UNITS):
        raise ConfigInvalid(where=where, reason=f"{key} = {text!r}: expected a number and a unit, "
                                                f"{_UNITS} (e.g. \"100mbit\"), or 0 for no cap")
    return int(float(m.group(1)) * _RATE_UNITS.get(m.group(2), 1))


def _req(doc: dict, key: str, where: str):
    if key not in doc:
        raise ConfigInvalid(where=where, reason=f"missing key {key!r}")
    return doc[key]


def _peer(name: str, p: dict, where: str, rel, tz) -> PeerConfig:
    transport = p.get("transport", "ssh")
    if transport not in TRANSPORT_KEYS:
        raise ConfigInvalid(where=where, reason=f"unknown transport {transport!r}; known: {sorted(TRANSPORT_KEYS)}")
    for key in TRANSPORT_KEYS[transport]:
        _req(p, key, where)

    def path(key: str) -> Path | None:
        return rel(p[key]) if p.get(key) else None
    nodes = {}
    for node, addr in (p.get("nodes") or {}).items():
        check_id(node, "peer node name")
        if not isinstance(addr, dict) or "host" not in addr:
            raise ConfigInvalid(where=where, reason=f"nodes.{node} needs host (and port)")
        nodes[node] = (addr["host"], int(addr.get("port", 22)))
    counts = {k: _whole(p, k, default, low, where) for k, default, low in
              (("max_syncs", 0, 0), ("connections", 2, 1), ("max_stripes", 16, 1), ("window", 2 << 20, 32 << 10),
               ("stripes", 0, 0))}
    bwlimit, bwschedule = parse_cap(p.get("bwlimit", 0), where, tz)
    ack = p.get("ack", "durable")
    if ack not in ACKS:
        raise ConfigInvalid(where=where, reason=f"ack = {ack!r}: expected one of {', '.join(ACKS)}")
    return PeerConfig(ack=ack, name=name, host=p.get("host", ""), port=int(p.get("port", 22)), user=p.get("user", "root"),
                      known_hosts=path("known_hosts"), key=path("key"), transport=transport, pool=path("pool"),
                      nodes=nodes, bwlimit=bwlimit, bwschedule=bwschedule,
                      link_rate=float(parse_bwlimit(p.get("link_rate", 0), where, "link_rate")), **counts)


def _whole(p: dict, key: str, default: int, low: int, where: str) -> int:
    v = p.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise ConfigInvalid(where=where, reason=f"{key} must be a whole number >= {low}, not {v!r}")
    return v


def check_node_name(name: str, where: str) -> str:
    """A storage node's name: Kubernetes node names are often FQDNs, so dots are allowed
    (ids read their node by the longest node name they start with); the last label must
    not be a queue suffix (RESERVED_NODE_NAMES)."""
    try:
        check_id(name, "node name")
    except DrsvcError as e:
        raise ConfigInvalid(where=where, reason=f"node name {name!r}: {e}") from None
    if name.endswith(".") or name.rsplit(".", 1)[-1] in RESERVED_NODE_NAMES:
        raise ConfigInvalid(where=where, reason=f"node name {name!r} ends in a dot or in a reserved word "
                                                f"({', '.join(sorted(RESERVED_NODE_NAMES))})")
    return name


def _node(name: str, n: dict, where: str, rel) -> NodeConfig:
    check_node_name(name, where)
    labels = n.get("labels") or {}
    if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
        raise ConfigInvalid(where=where, reason="labels must be a table of strings")
    peer_node = n.get("peer_node", "")
    if peer_node:
        check_id(peer_node, "peer_node")
    return NodeConfig(name=name, pool=rel(_req(n, "pool", where)), labels=dict(labels), peer_node=peer_node)


def _retention(doc: dict, where: str) -> str:
    """The site's default retention grid for recovery points (``retention = "..."``)."""
    if not doc.get("retention"):
        return ""
    try:
        return check_grid(str(doc["retention"]))
    except DrsvcError as e:
        raise ConfigInvalid(where=where, reason=f"retention: {e.message}") from None


REDIS_PASSWORD_ENV = "DRSVC_REDIS_PASSWORD"


def redis_url_with_password(url: str, password: str | None, where: str) -> str:
    """*url* (one server, or a Sentinel set: drsvc.redis_url) with the Redis password from the
    environment (DRSVC_REDIS_PASSWORD), so the password is given once, in a Secret read through
    env, and never in site.toml. A URL that carries a password of its own, as well as the
    variable, is refused: two sources would disagree."""
    try:
        redis_url.check(url)
        if not password:
            return url
        return redis_url.with_password(url, password)
    except redis_url.PasswordGivenTwice:
        raise ConfigInvalid(where=where, reason=f"redis_url carries a password and {REDIS_PASSWORD_ENV} is "
                                                "set too: give it once, in the environment") from None
    except redis_url.RedisUrlInvalid as e:
        raise ConfigInvalid(where=where, reason=str(e)) from None


def _verify(doc: dict, where: str) -> dict:
    """The site's verify (scrub) settings: verify_interval, verify_read_rate, verify_repair."""
    try:
        interval = parse_verify_interval(str(doc.get("verify_interval", DEFAULT_VERIFY_INTERVAL)),
                                         "verify_interval")
    except DrsvcError as e:
        raise ConfigInvalid(where=where, reason=f"verify_interval: {e.message}") from None
    repair = doc.get("verify_repair", False)
    if not isinstance(repair, bool):
        raise ConfigInvalid(where=where, reason="verify_repair: true or false")
    return {"verify_interval": interval, "verify_read_rate": parse_bwlimit(doc.get("verify_read_rate", 0), where,
                                                                           "verify_read_rate"),
            "verify_repair": repair}


def parse(doc: dict, path: Path | None = None, node: str = "") -> SiteConfig:
    where = str(path or "site config")
    base = path.parent if path else Path.cwd()

    def rel(p) -> Path:
        p = Path(p)
        return p if p.is_absolute() else base / p

    tz_name = str(doc.get("timezone", "UTC"))
    try:
        tz = zone(tz_name)
    except ScheduleInvalid as e:
        raise ConfigInvalid(where=where, reason=str(e)) from None
    peers = {}
    for name, p in (doc.get("peers") or {}).items():
        check_id(name, "peer name")
        peers[name] = _peer(name, p, f"{where} [peers.{name}]", rel, tz)
    bwlimit, bwschedule = parse_cap(doc.get("bwlimit", 0), where, tz)
    nodes = {}
    for name, n in (doc.get("nodes") or {}).items():
        nodes[name] = _node(name, n, f"{where} [nodes.{name}]", rel)
    site = check_id(_req(doc, "site", where), "site")
    # a multi-node site's controller has no pool of its own; its nodes each have one
    pool = rel(doc["pool"]) if doc.get("pool") else None
    if pool is None and not nodes:
        _req(doc, "pool", where)
    cfg = SiteConfig(site=site, node_id=doc.get("node_id", f"{site}-node"), pool=pool,
                      endpoint=doc.get("endpoint", ""),
                      redis_url=redis_url_with_password(doc.get("redis_url", "redis://127.0.0.1:6379/0"),
                                                        os.environ.get(REDIS_PASSWORD_ENV), where),
                      peers=peers, metrics_port=int(doc.get("metrics_port", 0)),
                      secrets_file=rel(doc["secrets_file"]) if doc.get("secrets_file") else None, path=path,
                      visibility_timeout=int(doc.get("visibility_timeout", 300)),
                      zone=check_id(doc["zone"], "zone") if doc.get("zone") else "", nodes=nodes,
                      node_call_timeout=float(doc.get("node_call_timeout", 30.0)),
                      retention=_retention(doc, where),
                      bwlimit=bwlimit, bwschedule=bwschedule, timezone=tz_name, **_verify(doc, where))
    return cfg.for_node(node) if node else cfg


def load(path: Path, node: str = "") -> SiteConfig:
    """The site config at *path*; with *node*, as that storage node's processes see it."""
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigNotFound(path=path) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigInvalid(where=f"site config {path}", reason=str(e)) from None
    return parse(doc, path, node)
