"""Shared steps for the consumer-flow tests: node calls and bounded controller loops."""
from __future__ import annotations

import time

import grpc

from csi_plugin.gen import csi_pb2

Code = grpc.StatusCode
RW_MOUNT = csi_pb2.VolumeCapability(mount=csi_pb2.VolumeCapability.MountVolume(fs_type="ext4"),
                                    access_mode=csi_pb2.VolumeCapability.AccessMode(mode=1))


def stage(client, vol, path, cap=RW_MOUNT):
    client.node.NodeStageVolume(csi_pb2.NodeStageVolumeRequest(
        volume_id=vol, staging_target_path=str(path), volume_capability=cap), timeout=120)


def unstage(client, vol, path):
    client.node.NodeUnstageVolume(csi_pb2.NodeUnstageVolumeRequest(
        volume_id=vol, staging_target_path=str(path)), timeout=120)


def publish(client, vol, staging, target, cap=RW_MOUNT, readonly=False):
    client.node.NodePublishVolume(csi_pb2.NodePublishVolumeRequest(
        volume_id=vol, staging_target_path=str(staging), target_path=str(target),
        volume_capability=cap, readonly=readonly), timeout=120)


def unpublish(client, vol, target):
    client.node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(
        volume_id=vol, target_path=str(target)), timeout=120)


def status_of(fn):
    """(code, response or None): the answer a controller sees."""
    try:
        return Code.OK, fn()
    except grpc.RpcError as e:
        return e.code(), None


def requeue(fn, until, *, attempts=120, delay=0.5, what="reconcile"):
    """A controller's reconcile loop with a bound: call fn until until(code, resp).
    Returns the history of codes; fails the test when the bound is reached."""
    seen = []
    for _ in range(attempts):
        code, resp = status_of(fn)
        seen.append(code)
        if until(code, resp):
            return seen, resp
        time.sleep(delay)
    raise AssertionError(f"{what}: no end after {attempts} calls; last codes {seen[-5:]}")
