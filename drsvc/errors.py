"""The one domain error tree.

Every failure the core reports is a subclass of :class:`DrsvcError`. Each class
names a condition; the edges (gRPC, CLI, Celery) map the *category* base
classes to their own codes in one table each. Messages are built from a
template and keyword fields so they stay human and never contain secrets.
"""
from __future__ import annotations


class DrsvcError(Exception):
    """Base of every domain error."""

    template = "drsvc error"

    def __init__(self, message: str | None = None, **fields):
        self.fields = fields
        if message is None:
            try:
                message = self.template.format(**fields)
            except (KeyError, IndexError):
                message = self.template
        self.message = message
        super().__init__(message)


# -- categories (mapped at the edges) -------------------------------------
class InvalidInput(DrsvcError):
    template = "invalid argument"


class NotFound(DrsvcError):
    template = "not found"


class Conflict(DrsvcError):
    """An object exists under that name with incompatible properties."""
    template = "already exists with different properties"


class OutOfRange(DrsvcError):
    template = "out of range"


class PreconditionFailed(DrsvcError):
    template = "precondition failed"


class OperationInProgress(DrsvcError):
    template = "an operation is already in progress for {key}"


class TaskSuperseded(OperationInProgress):
    """A task of a role change found that no caller waits for it any more: a stale copy,
    redelivered or published twice, whose claim on the unit is gone or another task's."""
    template = ("{op} of {unit_id} was not run: task {task_id} no longer holds the unit's claim "
                "(a stale or repeated message); a retry runs the operation anew")


class ResourceExhausted(DrsvcError):
    template = "resource exhausted"


class Unauthenticated(DrsvcError):
    template = "invalid or missing credentials"


class Unavailable(DrsvcError):
    """A transient condition: retrying later may succeed."""
    template = "temporarily unavailable"


class Unsupported(DrsvcError):
    template = "not supported"


class InternalError(DrsvcError):
    template = "internal error"


# -- conditions -------------------------------------------------------------
class InvalidName(InvalidInput):
    template = "invalid {what} {value!r}: {reason}"


class MissingField(InvalidInput):
    template = "{field} is required"


class InvalidParameter(InvalidInput):
    template = "parameter {key!r}: {reason}"


class UnsupportedCapability(InvalidInput):
    template = "unsupported volume capability: {reason}"


class VolumeNotFound(NotFound):
    template = "volume {volume_id!r} does not exist"


class SnapshotNotFound(NotFound):
    template = "snapshot {snapshot_id!r} does not exist"


class GroupNotFound(NotFound):
    template = "volume group {group_id!r} does not exist"


class VolumeExists(Conflict):
    template = "volume named {name!r} exists with different properties: {reason}"


class SnapshotExists(Conflict):
    template = "snapshot named {name!r} exists for a different source volume"


class CapacityOutOfRange(OutOfRange):
    template = "capacity {reason}"


class VolumeInUse(PreconditionFailed):
    template = "volume {volume_id!r} is in use: {reason}"


class VolumeAttached(VolumeInUse):
    """The image is attached read-write on this node: nothing may rewrite it underneath."""
    template = "volume {volume_id!r} is attached read-write on this node ({reason})"


class GroupIsReplica(PreconditionFailed):
    """A group received from the peer: its members follow the primary's."""
    template = ("volume group {group_id!r} is a replication secondary on this site: its members follow "
                "the primary's; change them there")


class NoSyncYet(NotFound):
    """GetVolumeReplicationInfo before the first sync: last_sync_time is REQUIRED."""
    template = "{unit_id!r} has no completed sync yet; replication details are not available"


class PoolFull(ResourceExhausted):
    template = "pool has {free} bytes free, {needed} needed"


class DrPoolFull(PoolFull):
    """A sync met a full filesystem at the peer: the transaction's data was removed there, and
    the replica stays at its last whole generation."""
    template = ("the DR pool at the peer is full: this sync needs about {needed_text}, {written_text} of it "
                "had arrived when {free_text} were left ({pool}); the sync's partial data was removed and the "
                "copy stays at generation {generation}. Free space there (or grow the pool): the next sync "
                "converges")


class DrPoolNoSpace(PoolFull):
    """The peer's pool filesystem was full outside a sync's data (its journal, a lock or state
    file, a recovery point's bookkeeping)."""
    template = ("the DR pool at the peer is full ({pool}): {reason}. Free space there (or grow the "
                "pool): the next attempt converges")


class BadPageToken(DrsvcError):
    """Mapped to ABORTED by CSI (the spec's code for an invalid starting_token)."""
    template = "invalid starting token {token!r}"


class CommandFailed(InternalError):
    """A process started by drsvc.runner failed; carries the stderr tail."""
    template = "{cmd} failed with exit code {rc}: {stderr}"

    def __init__(self, argv, rc, stderr_tail):
        self.argv = list(argv)
        self.rc = rc
        self.stderr_tail = stderr_tail
        super().__init__(cmd=self.argv[0], rc=rc, stderr=stderr_tail.strip() or "(no stderr)")


class CommandTimeout(CommandFailed):
    def __init__(self, argv, timeout, stderr_tail=""):
        self.timeout = timeout
        super().__init__(argv, -1, f"timed out after {timeout}s {stderr_tail}".strip())


class CorruptMetadata(InternalError):
    template = "metadata file {path} is unreadable: {reason}"


# -- replication ------------------------------------------------------------
class UnitNotFound(NotFound):
    template = "replication unit {unit_id!r} does not exist"


class PeerUnreachable(Unavailable):
    template = "peer {peer} is unreachable: {reason}"


class PeerUntrusted(PreconditionFailed):
    template = "host key of peer {peer} is not trusted: {reason}"


class HostKeyMismatch(PeerUntrusted):
    template = "host key of peer {peer} does not match the key pinned in {known_hosts}"


class PeerAuthFailed(PreconditionFailed):
    template = "peer {peer} refused the replication key: {reason}"


class ProtocolError(InvalidInput):
    template = "replication protocol error: {reason}"


class StreamCorrupt(ProtocolError):
    template = "replication stream corrupt: {reason}"


class UnsupportedVersion(ProtocolError):
    template = "protocol version {version} is not supported (supported: {supported})"


class UnknownVerb(ProtocolError):
    template = "verb {verb!r} is not allowed"


class BaseMismatch(PreconditionFailed):
    template = "replica {unit_id!r} is at generation {have}; the delta needs base {base}"


class SplitBrain(PreconditionFailed):
    """Both sites act as primary for a unit, or a deposed primary is fenced by its epoch."""
    template = "unit {unit_id!r}: split brain: {reason}"


class StaleEpoch(SplitBrain):
    template = "epoch {epoch} for {unit_id!r} is older than the replica's epoch {have}"


class ReplicaIsPrimary(SplitBrain):
    template = "unit {unit_id!r} is primary on this site and accepts no deltas"


class NotPrimary(PreconditionFailed):
    template = "unit {unit_id!r} is {role} on this site; only a primary syncs"


class NotSecondary(PreconditionFailed):
    template = "{kind} {unit_id} is not demoted; only a secondary resyncs"


class NotEnabled(PreconditionFailed):
    template = "replication is not enabled for {kind} {unit_id}"


class NeedsResync(PreconditionFailed):
    template = "{unit_id} needs a resync before it can be promoted"


class ReplicaKnownBad(PreconditionFailed):
    template = ("the replica of {unit_id} failed its verify: {detail}; repair it first "
                "(`drsvc verify --repair`), or {action} with force to take it as it is")


class PointKnownBad(PreconditionFailed):
    template = ("recovery point {generation} of {unit_id} is built through point {damaged}, which failed its "
                "verify ({detail}); it cannot be repaired from the primary: choose another point, or "
                "{action} with force to take it as it is")


class RepairAsked(PreconditionFailed):
    template = ("the replica of {unit_id} asks for a repair: the blocks its verify found differing go "
                "with the next delta, which must name them")


class PeerNotDemoted(PreconditionFailed):
    template = "the peer has not demoted {unit_id} at this site's generation {generation}"


class PeerNotRecorded(PreconditionFailed):
    template = "{unit_id} has no record of its peer; cannot become primary"


class GroupEmpty(InvalidInput):
    template = "volume group {group_id} has no volumes; add some before enabling replication"


class VolumeInGroup(InvalidInput):
    template = "volume {volume_id} belongs to volume group {group_id}: replicate the group"


class VolumeIsGroupMember(PreconditionFailed):
    """Promote, demote or resync of one member of a replicated group: the group is the unit."""
    template = ("{volume_id} is a member of {group_id}; use --group {group_id} (a member replicates, "
                "fails over and resyncs with its group)")


class ReplicationConflict(PreconditionFailed):
    template = "unit {unit_id!r}: {reason}"


class RoundUndecided(ReplicationConflict):
    template = ("unit {unit_id!r}: generation {target} (round {round}) is prepared here and waits for its "
                "round's decision; nothing else is applied before it")


class RoundAborted(Unavailable):
    template = ("unit {unit_id!r}: not every storage node of the group {reason}; this round was "
                "aborted everywhere and the next one captures again")


class TransactionEnded(Unavailable):
    template = ("unit {unit_id!r}: its transaction ended before this stripe's records were journaled; "
                "the sender resumes after what landed")


class ImageResized(Unavailable):
    template = ("volume {volume_id!r} was resized while its generation was captured, after records "
                "had left; the sync is cut here and the next one sends it at its new size")


class ImageInUse(PreconditionFailed):
    template = ("replica image of {volume_id!r} (unit {unit_id!r}) is attached read-write "
                "({holder}); the receiver applies nothing under it")


class RemoteError(InternalError):
    template = "peer failed: {reason}"


# -- configuration and the edges' plumbing ------------------------------------
class ConfigInvalid(InvalidInput):
    template = "{where}: {reason}"


class ConfigNotFound(NotFound):
    template = "site config {path} does not exist"


class UnsupportedEndpoint(InvalidInput):
    template = "unsupported endpoint {endpoint!r}: use unix:///path/to/csi.sock"


class PeerRequired(InvalidInput):
    template = "parameter 'peer' is required: site {site} has {count} peers ({names})"


class PeerNotFound(NotFound):
    template = "site {site} has no peer named {name!r}"


class BrokerUnreachable(Unavailable):
    template = "this site's Redis is unreachable: {reason}"


class WorkerFailed(InternalError):
    template = "{op} of {unit_id} failed in the worker: {reason}"


# -- CSI snapshots, group snapshots, volume modification -----------------------
class GroupSnapshotNotFound(NotFound):
    template = "volume group snapshot {group_snapshot_id!r} does not exist"


class GroupSnapshotExists(Conflict):
    template = "volume group snapshot named {name!r} exists with different {reason}"


class SnapshotListMismatch(InvalidInput):
    template = "snapshot_ids do not match volume group snapshot {group_snapshot_id!r}: {reason}"


class SnapshotInGroup(InvalidInput):
    template = ("snapshot {snapshot_id!r} is part of volume group snapshot {group_snapshot_id!r}; "
                "delete the group snapshot instead")


class NotGroupConsistent(PreconditionFailed):
    template = "volumes cannot be snapshotted together at one instant: {reason}"


class ParameterNotMutable(InvalidInput):
    template = "parameter {key!r} cannot be modified here: {reason}"


class StartingOffsetOutOfRange(OutOfRange):
    template = "starting_offset {offset} is outside the snapshot's {size} bytes"


class SnapshotsOfDifferentVolumes(InvalidInput):
    template = ("base snapshot {base!r} is of volume {base_volume!r}, target snapshot {target!r} of "
                "volume {target_volume!r}: a delta needs two snapshots of the same volume")


class BaseNewerThanTarget(InvalidInput):
    template = "base snapshot {base!r} was taken after target snapshot {target!r}"


class MaxResultsNegative(InvalidInput):
    template = "max_results must not be negative, got {value}"


# -- sites of several storage nodes -----------------------------------------------
class NodeNotFound(NotFound):
    template = "site {site} has no storage node named {node!r} (nodes: {names})"


class NoNodeFits(ResourceExhausted):
    template = "no storage node of site {site} can hold this volume: {reason}"


class NodeUnreachable(Unavailable):
    template = "storage node {node} of site {site} did not answer within {wait:.0f}s: {reason}"


class ReplicationNotConfigured(PreconditionFailed):
    template = "site {site} has no peers in its config: replication is not configured there"


class GroupSpansNodes(InvalidInput):
    template = ("volumes of one group must sit on one storage node on a multi-node site (for now): "
                "{reason}")


# -- recovery points ---------------------------------------------------------------
class RetentionGridInvalid(InvalidInput):
    template = "retention grid part {part!r} {reason}"


class PointNotFound(NotFound):
    template = "unit {unit_id!r} has no recovery point {point}"


class PointNotRestorable(PreconditionFailed):
    template = "recovery point {generation} of unit {unit_id!r} cannot be restored: {reason}"
