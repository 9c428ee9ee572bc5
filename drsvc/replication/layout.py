"""Pool paths for replication: the pool's one layout object lives in drsvc.layout."""
from __future__ import annotations

from ..layout import PoolLayout, check_id

__all__ = ["PoolLayout", "check_id"]
