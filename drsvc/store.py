"""Durable metadata: atomic JSON documents with a schema version, and file locks.

Writes go to a temp file in the same directory, are fsynced, renamed over the
target, and the directory is fsynced, so a crash leaves either the old or the
new document, never half of one.

A caller that writes several documents for one request may defer the directory
fsync (``sync_dir=False``) and call :func:`fsync_dirs` once before it answers:
every fsync is still made, but on a journaling filesystem (XFS, ext4) the
directory fsyncs that follow a file fsync find their changes already in the
journal and cost almost nothing, where interleaved they each force the journal.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import time
from pathlib import Path

from .errors import CorruptMetadata, OperationInProgress

SCHEMA_VERSION = 1


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dirs(*paths: Path) -> None:
    """fsync each distinct directory among *paths* (in the order given)."""
    for path in dict.fromkeys(Path(p) for p in paths):
        fsync_dir(path)


def fsync_file(path: Path) -> None:
    """Make the data of the file at *path*, written without fsync, durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_files(paths, *, directory: Path | None = None) -> None:
    """One durability barrier for files written without fsync, then *directory*, which
    names them. Sequential: thread wake-ups on a busy host cost more than the log forces
    concurrent fsyncs could share."""
    for p in paths:
        fsync_file(p)
    if directory is not None:
        fsync_dir(directory)


def atomic_write_bytes(path: Path, data: bytes, *, sync_dir: bool = True, durable: bool = True) -> None:
    """Write *data* to *path* whole via a temp file and a rename. ``sync_dir=False``: the
    caller fsyncs the directory (:func:`fsync_dirs`). ``durable=False`` skips both fsyncs,
    for files in a private directory that a later barrier (:func:`fsync_files`) makes durable."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if sync_dir and durable:
        fsync_dir(path.parent)


def write_ephemeral_json(path: Path, doc: dict) -> None:
    """Replace the JSON file at *path* whole, without fsync: for files that only describe
    the running moment (a sync's progress, the scheduler's next runs) and may be lost."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def read_json(path: Path) -> dict | None:
    """The JSON document at *path*, or None when it is absent or unreadable."""
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, ValueError):
        return None


def write_doc(path: Path, doc: dict, *, sync_dir: bool = True, durable: bool = True) -> None:
    body = dict(doc)
    body["schema"] = SCHEMA_VERSION
    atomic_write_bytes(path, json.dumps(body, sort_keys=True, indent=1).encode(), sync_dir=sync_dir,
                       durable=durable)


class StagedDoc:
    """A document written beside *path* under a temp name, put in place by :meth:`commit`.

    For a request that writes several documents and wants their journal commits
    to coincide: write them all first, then ``sync()`` (fsync of the temp file)
    and ``commit()`` (fsync if not done yet, rename over *path*, fsync of the
    directory unless ``sync_dir=False``) in the order durability needs. Used as
    a context manager, an uncommitted temp file is removed on the way out."""

    def __init__(self, path: Path, doc: dict):
        self.path = Path(path)
        body = dict(doc)
        body["schema"] = SCHEMA_VERSION
        self.tmp = self.path.with_name(f".{self.path.name}.tmp.{os.getpid()}")
        self.synced = self.committed = False
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(json.dumps(body, sort_keys=True, indent=1).encode())
            while view:
                view = view[os.write(self.fd, view):]
        except BaseException:
            self.close()
            raise

    def sync(self) -> None:
        if not self.synced:
            os.fsync(self.fd)
            self.synced = True

    def commit(self, *, sync_dir: bool = True) -> None:
        self.sync()
        os.replace(self.tmp, self.path)
        self.committed = True
        if sync_dir:
            fsync_dir(self.path.parent)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if not self.committed:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.tmp)

    def __enter__(self) -> StagedDoc:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_pointer(path: Path, target: str, *, sync_dir: bool = True) -> None:
    """Make *path* a record holding only *target* (an id), atomically: a symlink to *target*
    made under a temp name and renamed over *path*.

    A symlink is created with its target in one step and carries it in its inode:
    there is no data block to write or fsync, only the directory (with ``sync_dir``
    or the caller's own fsync_dirs). The target is never followed as a path: read
    it with :func:`read_pointer`. Only for validated ids (no '/')."""
    path = Path(path)
    if "/" in target or not target:
        raise ValueError(f"a pointer holds an id, not {target!r}")
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    os.symlink(target, tmp)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if sync_dir:
        fsync_dir(path.parent)


def read_pointer(path: Path, field: str) -> str | None:
    """The id a record at *path* holds: a pointer's target (write_pointer), or the *field*
    of a JSON document there (records written before pointers); None when there is none."""
    try:
        return os.readlink(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno != errno.EINVAL:          # EINVAL: not a symlink, a document
            raise
    doc = read_doc(path)
    if doc is None:
        return None
    value = doc.get(field)
    if not isinstance(value, str):
        raise CorruptMetadata(path=str(path), reason=f"no {field}")
    return value


def remove_tree(path, *, ignore_errors: bool = False) -> None:
    """``shutil.rmtree``, with shutil (and the bz2, lzma and fnmatch it loads) imported only
    when a tree is removed: the receiver, which starts once per channel, removes one in few
    of its runs."""
    import shutil
    shutil.rmtree(path, ignore_errors=ignore_errors)


def remove_temps(path: Path) -> None:
    """Remove temp files that writers of *path* killed mid-write left beside it (any pid)."""
    path = Path(path)
    for tmp in path.parent.glob(f".{path.name}.tmp.*"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def read_doc(path: Path) -> dict | None:
    """Return the document at *path*, or None when it does not exist."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise CorruptMetadata(path=str(path), reason=str(e)) from None
    if not isinstance(doc, dict):
        raise CorruptMetadata(path=str(path), reason="not an object")
    if doc.get("schema", 0) > SCHEMA_VERSION:
        raise CorruptMetadata(path=str(path), reason=f"schema {doc.get('schema')} is newer than {SCHEMA_VERSION}")
    return doc


def close_file(f, keep: bool = True) -> None:
    """Close a buffered file. With *keep* false it is about to be removed: a failed flush of
    what is still buffered (ENOSPC, EDQUOT) is dropped with it. The descriptor is closed
    either way (a buffered close releases it after a failed flush)."""
    try:
        f.close()
    except OSError:
        if keep:
            raise


def remove(path: Path) -> bool:
    """Remove *path* durably; returns False when it was already gone."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    fsync_dir(Path(path).parent)
    return True


@contextlib.contextmanager
def file_lock(path: Path, *, blocking: bool = True, key: str | None = None, wait: float | None = None,
              shared: bool = False):
    """An flock held across processes (*shared*: LOCK_SH, which other shared holders share).
    Non-blocking raises OperationInProgress; with *wait*, it is tried for that many seconds first."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + (wait or 0.0)
        while True:
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
                            | (0 if blocking and wait is None else fcntl.LOCK_NB))
                break
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                if time.monotonic() >= deadline:
                    raise OperationInProgress(key=key or Path(path).name) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)
