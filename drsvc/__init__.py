"""drsvc core: volumes, groups, replication state and per-site config.

This package imports no grpc, celery, apscheduler or paramiko outside the
single adapter modules named in docs/architecture.md.
"""
import os

__version__ = "0.1.0"

# numpy serves drsvc as integer array algebra (extent maps, range sets), never for BLAS; its
# OpenBLAS would otherwise start a thread per core in every process that imports it (each
# receiver, worker and plugin) and spin them: 0.13 -> 0.055 s of CPU per receiver start
# here. Set before anything of drsvc imports numpy; an operator's own setting stands.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
