"""CSI SnapshotMetadata (server streaming): allocated and changed block ranges of snapshots.

The style of the stream (FIXED_LENGTH 4 KiB blocks or VARIABLE_LENGTH merged
extents) is the plugin's choice, set once per plugin (``--block-metadata``);
it never changes mid-stream. Every stream starts with one message carrying the
type and the capacity, even when no range follows.
"""
from __future__ import annotations

import itertools
import logging

import grpc

from drsvc.errors import DrsvcError, MaxResultsNegative
from drsvc.ids import check_map
from drsvc.site import Site
from drsvc.snapshot_metadata import BLOCK, SnapshotMetadataService, fixed_length

from .errors import code_for
from .gen import csi_pb2, csi_pb2_grpc

log = logging.getLogger(__name__)
STYLES = {"variable": csi_pb2.VARIABLE_LENGTH, "fixed": csi_pb2.FIXED_LENGTH}
DEFAULT_MAX_RESULTS = 1024


def _abort(context, method: str, e: DrsvcError):
    code = code_for(e)
    if code == grpc.StatusCode.INTERNAL:
        log.error("%s failed: %s", method, e)
    context.abort(code, e.message)


class SnapshotMetadata(csi_pb2_grpc.SnapshotMetadataServicer):
    def __init__(self, site: Site, style: str = "variable"):
        self.service = SnapshotMetadataService(site.volumes)
        self.style = STYLES[style]

    def _stream(self, context, method: str, response_cls, req, compute):
        try:
            check_map(dict(req.secrets), "secrets")
            if req.max_results < 0:
                raise MaxResultsNegative(value=req.max_results)
            md = compute()
        except DrsvcError as e:
            _abort(context, method, e)
        except OSError as e:
            log.error("%s: opening snapshot images failed: %s", method, e)
            context.abort(grpc.StatusCode.INTERNAL, f"opening snapshot images failed: {e}")
        ranges = fixed_length(md.ranges, BLOCK) if self.style == csi_pb2.FIXED_LENGTH else md.ranges
        per_message = req.max_results or DEFAULT_MAX_RESULTS
        first = True
        try:
            while True:
                batch = list(itertools.islice(ranges, per_message))
                if not batch and not first:
                    return
                first = False
                yield response_cls(block_metadata_type=self.style, volume_capacity_bytes=md.capacity_bytes,
                                   block_metadata=[csi_pb2.BlockMetadata(byte_offset=o, size_bytes=n)
                                                   for o, n in batch])
                if len(batch) < per_message:
                    return
        except DrsvcError as e:
            _abort(context, method, e)
        except OSError as e:
            log.error("%s: reading snapshot images failed: %s", method, e)
            context.abort(grpc.StatusCode.INTERNAL, f"reading snapshot images failed: {e}")

    def GetMetadataAllocated(self, req, context):
        yield from self._stream(context, "GetMetadataAllocated", csi_pb2.GetMetadataAllocatedResponse, req,
                                lambda: self.service.allocated(req.snapshot_id, req.starting_offset))

    def GetMetadataDelta(self, req, context):
        yield from self._stream(context, "GetMetadataDelta", csi_pb2.GetMetadataDeltaResponse, req,
                                lambda: self.service.delta(req.base_snapshot_id, req.target_snapshot_id,
                                                           req.starting_offset))
