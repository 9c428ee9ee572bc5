"""ControllerModifyVolume: the mutable parameters of a volume (Kubernetes VolumeAttributesClass).

Mutable here: ``preallocate`` ("true" allocates every block of the image now,
so writes can no longer fail for lack of pool space; "false" records that the
volume need not stay fully allocated; blocks already allocated stay).

Not mutable here: a volume's replication settings. They belong to its
VolumeReplicationClass and change through the replication service, so a key
of that class is refused with INVALID_ARGUMENT naming the class.

Validation happens before anything changes, so a refused call modifies nothing.
"""
from __future__ import annotations

import logging
import os

from . import store
from .errors import InvalidParameter, ParameterNotMutable, PoolFull
from .ids import check_id, check_map
from .model import Volume
from .replication.control import KNOWN_PARAMETERS as REPLICATION_CLASS_KEYS
from .volumes import VolumeService

log = logging.getLogger(__name__)
MUTABLE = {"preallocate": ("true", "false")}
# a VolumeReplicationClass's keys: drsvc.replication's parameters, and the CO's prefix
REPLICATION_CLASS_PREFIX = "replication.storage.openshift.io/"


def check_mutable(parameters: dict) -> dict:
    params = dict(check_map(dict(parameters), "mutable_parameters"))
    for key, value in sorted(params.items()):
        if key in REPLICATION_CLASS_KEYS or key.startswith(REPLICATION_CLASS_PREFIX):
            raise ParameterNotMutable(key=key, reason="replication settings belong to the volume's "
                                      "VolumeReplicationClass; change them through volume replication")
        if key not in MUTABLE:
            raise InvalidParameter(key=key, reason=f"not a mutable parameter; mutable: {sorted(MUTABLE)}")
        if value not in MUTABLE[key]:
            raise InvalidParameter(key=key, reason=f"must be one of {list(MUTABLE[key])}")
    return params


class VolumeModifier:
    def __init__(self, volumes: VolumeService):
        self.volumes = volumes
        self.pool = volumes.pool

    def modify(self, volume_id: str, parameters: dict) -> Volume:
        """Apply *parameters* (only the keys given; repeat-safe)."""
        check_id(volume_id)
        params = check_mutable(parameters)
        with self.pool.lock(volume_id):
            vol = self.volumes.get_volume(volume_id)
            if params.get("preallocate") == "true":
                self._preallocate(vol)
            if params and any(vol.mutable_parameters.get(k) != v for k, v in params.items()):
                vol.mutable_parameters = {**vol.mutable_parameters, **params}
                store.write_doc(self.pool.volume_meta(volume_id), vol.to_doc())
                log.info("volume %s modified: %s", volume_id, params)
            return vol

    def _preallocate(self, vol: Volume) -> None:
        image = self.pool.image(vol.volume_id)
        with open(image, "r+b") as f:
            st = os.fstat(f.fileno())
            missing = max(0, st.st_size - st.st_blocks * 512)
            free, _ = self.pool.space()
            if missing > free:
                raise PoolFull(free=free, needed=missing)
            if missing:
                # FALLOC mode 0 keeps existing data and only allocates the holes
                os.posix_fallocate(f.fileno(), 0, st.st_size)
                os.fsync(f.fileno())
