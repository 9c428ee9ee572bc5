"""drsvc core: volumes, groups, replication state and per-site config.

This package imports no grpc, celery or redis, and only the SSH transport
(drsvc.transport.ssh) imports paramiko: tests/unit/test_layers.py holds it to that.
"""
import os

__version__ = "0.1.0"

# numpy serves drsvc as integer array algebra (extent maps, range sets), never for BLAS; its
# OpenBLAS would otherwise start a thread per core in every process that imports it (each
# receiver, worker and plugin) and spin them, which more than doubles a receiver's start in
# CPU. Set before anything of drsvc imports numpy; an operator's own setting stands.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
