"""drsvc core: volumes, groups, replication state and per-site config.

This package imports no grpc, celery, apscheduler or paramiko outside the
single adapter modules named in docs/architecture.md.
"""
__version__ = "0.1.0"
