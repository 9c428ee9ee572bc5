"""Keep a lab's logs past its teardown, for a failure to be read afterwards.

Set ``DRSVC_LAB_KEEP_LOGS`` to a directory: each lab torn down copies the ``*.log`` files
below its root there (into a directory named after the root), the components' logs
in the run directories beside the pools (inside the pools' filesystems) included. Unset,
nothing is kept.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

ENV = "DRSVC_LAB_KEEP_LOGS"


def keep_logs(root: Path) -> Path | None:
    """Copy the lab's logs to $DRSVC_LAB_KEEP_LOGS/<root's name>/; where they went, or None."""
    dest_root = os.environ.get(ENV)
    if not dest_root or not Path(root).is_dir():
        return None
    dest = Path(dest_root) / Path(root).name
    for dirpath, _dirs, filenames in os.walk(root):
        for name in filenames:
            if name.endswith(".log"):
                src = Path(dirpath) / name
                to = dest / src.relative_to(root)
                to.parent.mkdir(parents=True, exist_ok=True)
                try:
                    shutil.copyfile(src, to)
                except OSError:
                    pass            # a log going away as it is copied: keep the rest
    return dest
