"""The same replication calls the csi-addons sidecar makes, straight to a site's plugin
socket, with no Kubernetes in between: the drsvc-only figure a failover through the
controllers is measured against."""
from __future__ import annotations

import time

import grpc

from csi_plugin.gen import csi_pb2, csi_pb2_grpc, replication_pb2, replication_pb2_grpc


class Direct:
    def __init__(self, socket, token: str, parameters: dict):
        self.channel = grpc.insecure_channel(f"unix://{socket}")
        self.csi = csi_pb2_grpc.ControllerStub(self.channel)
        self.repl = replication_pb2_grpc.ControllerStub(self.channel)
        self.secrets = {"token": token}
        self.parameters = parameters

    def close(self) -> None:
        self.channel.close()

    def create_volume(self, name: str, size: int = 64 << 20) -> str:
        cap = csi_pb2.VolumeCapability(mount=csi_pb2.VolumeCapability.MountVolume(fs_type="ext4"),
                                       access_mode=csi_pb2.VolumeCapability.AccessMode(mode=1))
        return self.csi.CreateVolume(csi_pb2.CreateVolumeRequest(
            name=name, capacity_range=csi_pb2.CapacityRange(required_bytes=size),
            volume_capabilities=[cap])).volume.volume_id

    def call(self, method: str, volume_id: str, **fields):
        """One call in the sidecar's form (replication_source), retried while ABORTED
        (an operation in progress), as the controller requeues; returns (answer, ABORTED count)."""
        req = getattr(replication_pb2, f"{method}Request")(secrets=self.secrets, **fields)
        if method != "GetVolumeReplicationInfo":
            req.parameters.update(self.parameters)
        req.replication_source.volume.volume_id = volume_id
        aborted = 0
        while True:
            try:
                return getattr(self.repl, method)(req, timeout=120), aborted
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.ABORTED or aborted > 600:
                    raise
                aborted += 1
                time.sleep(0.1)

    def last_sync(self, volume_id: str) -> float:
        """The last sync's time (seconds since the epoch), 0 when NOT_FOUND (none yet)."""
        try:
            info, _ = self.call("GetVolumeReplicationInfo", volume_id)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return 0.0
            raise
        return info.last_sync_time.ToSeconds() + info.last_sync_time.nanos / 1e9
