"""The block maps of a secondary's replica, kept up to date as transactions apply.

A Promote makes the received images the acked base of the new primary's first sync
(``takeover.seed_base``). A base needs a block map of every member: the xxh3-128 digest of
each block, exactly as the sender's scan computes it. Building one reads the whole
volume, and its cost grows with the volume. So the receiver keeps the maps as
transactions apply:

- Each data record's block digests are computed as the record arrives, while its payload
  is in hand. They are appended to the journal's ``digests.bin`` (``JournalDigests``),
  which is handed to the kernel with the records at the commit.
- The apply writes them into ``maps/<vol>.map``. Zero records clear their slots, and a new
  member's map is built whole. It then records in ``maps/maps.json`` the generation and
  transaction the maps describe, with each image's identity (inode, size, ctime) as the
  apply left it (``ReplicaMaps``).
- The maps are used only when that record matches the unit's state and every image is as
  the apply left it. Anything else that changed an image makes them unused: a promote to
  a point, writes while primary, or a replay whose first apply was cut short. The
  promote then falls back to reading the volume.

Neither the digests nor the maps are fsynced on a sync's path: on a 1% sync of 1 GiB the
map's pages alone are 4 MiB to write back, and the fsyncs cost the peer 30-40 ms a sync.
A killed process loses nothing the kernel holds, so both carry the boot they were written
in (``/proc/sys/kernel/random/boot_id``), and unsynced ones count only within that boot. The
maps are made durable at most once every ``DURABLE_EVERY`` seconds, so a reboot costs at
most the maps' last minute of transactions (they are unused until the next role change).
A promote that uses them makes durable copies of them in the base it seeds: the copy is a
reflink (which writes the source's dirty pages back first) or a byte copy, then fsynced,
so the maps themselves need no fsync there.

A Demote seeds them from its final sync's acked snapshot (``seed_from_base``), which holds
the same content with its maps. It does so only when no write reached the images after that
capture. The roles can then go back and forth without a read of the volume at either site.
"""
from __future__ import annotations

import os
import struct
import threading
import time
from functools import lru_cache
from pathlib import Path

from ... import store
from ...layout import PoolLayout
from ...logs import logger
from .blockmap import DIGEST, HEADER, MAP_PAGE, BlockMap, block_count, copy_map, digest_blocks

log = logger(__name__)

# member u16 | first block u64 | block count u32, then that many digests
DIGEST_ENTRY = struct.Struct(">HQI")
DIGESTS_HEADER = struct.Struct(">8s40s")      # magic | the boot the file was written in
DIGESTS_MAGIC = b"DRDIGST1"
DURABLE_EVERY = 60.0         # seconds between fsyncs of a unit's maps (and at a promote)
UNUSABLE = 0xFFFF            # an entry with this member: the records cannot be mapped (unaligned)
_BUF = 1 << 20
# A Demote seeds the maps only when the images' last change is older than its final
# capture by this much: ctime comes from the kernel's coarse clock, which lags a tick.
CAPTURE_SLACK_NS = 50_000_000


@lru_cache(maxsize=1)
def boot_id() -> str:
    """This boot's id: what the kernel held unsynced survives a killed process, not a reboot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


class JournalDigests:
    """``journal/digests.bin``: the block digests of every data record the journal holds,
    one entry per record, in arrival order. Safe to call from the stripes' threads."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._f = None
        self._lock = threading.Lock()

    @staticmethod
    def digest(offset: int, block_size: int, data) -> bytes | None:
        """The record's block digests; None when it does not start on a block boundary."""
        return digest_blocks(data, block_size) if offset % block_size == 0 else None

    def reset(self) -> None:
        self.close()
        with open(self.path, "wb") as f:
            f.write(DIGESTS_HEADER.pack(DIGESTS_MAGIC, boot_id().encode()))

    def add(self, member: int, offset: int, block_size: int, digests: bytes | None) -> None:
        with self._lock:
            if self._f is None:
                self._f = open(self.path, "ab", buffering=_BUF)  # noqa: SIM115 - closed by close()
            if digests is None:
                self._f.write(DIGEST_ENTRY.pack(UNUSABLE, 0, 0))
                return
            self._f.write(DIGEST_ENTRY.pack(member, offset // block_size, len(digests) // DIGEST))
            self._f.write(digests)

    def flush(self) -> None:
        """To the kernel (not to disk: the file counts only within this boot)."""
        with self._lock:
            if self._f is not None:
                self._f.flush()

    def close(self, keep: bool = True) -> None:
        """Close the file; with *keep* false it is about to be removed, and a failed flush of
        what is still buffered (a full filesystem) is dropped with it."""
        with self._lock:
            f, self._f = self._f, None
            if f is not None:
                store.close_file(f, keep)

    @staticmethod
    def entries(path: Path):
        """(member, first block, digests) of each entry; a torn tail ends the listing, and a
        file written in another boot (or without a header) has none."""
        with open(path, "rb", buffering=_BUF) as f:
            magic, boot = DIGESTS_HEADER.unpack(f.read(DIGESTS_HEADER.size).ljust(DIGESTS_HEADER.size, b"\0"))
            if magic != DIGESTS_MAGIC or not boot_id() or boot.rstrip(b"\0").decode(errors="replace") != boot_id():
                return
            buf, at = b"", 0
            while True:
                if len(buf) - at < DIGEST_ENTRY.size:
                    buf, at = buf[at:] + f.read(_BUF), 0
                    if len(buf) < DIGEST_ENTRY.size:
                        return
                member, first, count = DIGEST_ENTRY.unpack_from(buf, at)
                end = at + DIGEST_ENTRY.size + count * DIGEST
                if end > len(buf):
                    buf, at = buf[at:] + f.read(max(_BUF, end - at)), 0
                    end = DIGEST_ENTRY.size + count * DIGEST
                    if end > len(buf):
                        return          # a torn tail
                yield member, first, buf[at + DIGEST_ENTRY.size:end]
                at = end


def _identity(path: Path) -> list[int]:
    st = os.stat(path)
    return [st.st_ino, st.st_size, st.st_ctime_ns]


class ReplicaMaps:
    """One unit's replica maps and the record of what they describe."""

    def __init__(self, layout: PoolLayout, unit_id: str):
        self.layout, self.unit_id = layout, unit_id
        self.dir = layout.replica_maps_dir(unit_id)
        self.doc_path = layout.replica_maps_doc(unit_id)
        self._durable_at = 0.0        # when the maps were last fsynced (the record before this apply)

    def path(self, volume_id: str) -> Path:
        return self.layout.replica_map(self.unit_id, volume_id)

    def copy_to(self, volume_id: str, dst: Path) -> None:
        """A durable copy of a member's map (a reflink where the pool has them)."""
        _copy_durably(self.path(volume_id), dst)

    def _describes(self, generation: int, txid: str | None, members, block_size: int | None) -> bool:
        """Whether the maps describe exactly *members*' images at this generation."""
        doc = store.read_doc(self.doc_path)
        if not doc or doc.get("generation") != generation or doc.get("txid") != txid:
            return False
        if not doc.get("durable") and (not boot_id() or doc.get("boot") != boot_id()):
            return False          # written back unsynced before a reboot: maybe not all of it
        if block_size is not None and doc.get("block_size") != block_size:
            return False
        recorded = doc.get("members") or {}
        try:
            return all(vol in recorded and self.path(vol).exists()
                       and _identity(self.layout.image(vol)) == recorded[vol] for vol in members)
        except FileNotFoundError:
            return False

    def recorded_for(self, st) -> bool:
        """The maps were written by the applies up to the unit's recorded generation, whether or
        not an image changed since: a verify checks the images against them, and a change
        made to an image outside a transaction is what it looks for."""
        doc = store.read_doc(self.doc_path)
        if not st.members or not doc or (doc.get("generation"), doc.get("txid")) != (st.generation, st.txid):
            return False
        if not doc.get("durable") and (not boot_id() or doc.get("boot") != boot_id()):
            return False
        return doc.get("block_size") == st.block_size and all(
            vol in (doc.get("members") or {}) and self.path(vol).exists() for vol in st.members)

    def valid(self, st) -> bool:
        """The maps describe the unit's images at its recorded generation (a promote's base)."""
        return bool(st.members) and self._describes(st.generation, st.txid, st.members, st.block_size)

    def begin_apply(self, tx: dict, st) -> bool:
        """Before a transaction changes the images: whether the maps can follow it (they
        describe the images it applies to, or every member is new). The record goes either
        way; it is written again once the maps describe the new generation. The maps never
        fail a transaction: whatever goes wrong with them leaves them unused."""
        try:
            return self._begin_apply(tx, st)
        except Exception as e:        # noqa: BLE001 - an optimisation must not fail the commit
            log.warning("%s: block maps of the replica left unused (%s)", self.unit_id, e)
            self._drop_record()
            return False

    def _begin_apply(self, tx: dict, st) -> bool:
        old = [m["volume_id"] for m in tx["members"] if not m["fresh"]]
        follow = not old or (st is not None and self._describes(st.generation, st.txid, old, tx["block_size"]))
        if follow and old:
            self._durable_at = float((store.read_doc(self.doc_path) or {}).get("durable_at") or 0.0)
        self.invalidate()
        return follow

    def invalidate(self) -> None:
        """The maps no longer describe the images (not durable: a later record is)."""
        try:
            os.unlink(self.doc_path)
        except FileNotFoundError:
            pass

    def discard(self) -> None:
        """This site no longer receives (it became primary): the maps go."""
        self.invalidate()
        store.remove_tree(self.dir, ignore_errors=True)

    def apply(self, tx: dict, digests_path: Path, records) -> bool:
        """After the transaction's images are durable: write its digests into the maps (and
        fsync them when the last fsync is DURABLE_EVERY old), and record what they now
        describe. *records*: (member, is_zero, offset, length) of each record it applied.
        Returns False (the maps stay unused) when the digests do not cover exactly the data
        records, or anything fails (a full pool): the maps never fail a transaction."""
        try:
            return self._apply(tx, digests_path, records)
        except Exception as e:        # noqa: BLE001 - an optimisation must not fail the commit
            log.warning("%s: block maps of the replica left unused (%s)", self.unit_id, e)
            self._drop_record()
            return False

    def _drop_record(self) -> None:
        try:
            self.invalidate()
        except OSError:
            pass

    def _apply(self, tx: dict, digests_path: Path, records) -> bool:
        """The records' digests and holes into the maps in the records' own order (arrival
        order, which is plan order where two records cover one block: ``capture_feed``); each
        data record takes the next digests entry, which must name its blocks."""
        bs = tx["block_size"]
        members = tx["members"]
        self.dir.mkdir(parents=True, exist_ok=True)
        maps = self._open(members, bs)
        durable = time.time() - self._durable_at >= DURABLE_EVERY
        digests = JournalDigests.entries(digests_path) if digests_path.exists() else iter(())
        try:
            for member, is_zero, offset, length in records:
                if is_zero:
                    if not members[member]["fresh"]:       # a new image's map starts empty
                        maps[member].clear(offset // bs, block_count(length, bs))
                    continue
                if not self._write_next(maps, digests, member, offset // bs, block_count(length, bs)):
                    return False
            if next(digests, None) is not None:
                log.warning("%s: the journal holds digests of no record: maps not kept", self.unit_id)
                return False
        finally:
            for m in maps.values():
                m.close(durable)
        self._record(tx["target"], tx["txid"], [m["volume_id"] for m in members], bs, durable=durable)
        return True

    def _write_next(self, maps: dict, digests, member: int, first: int, count: int) -> bool:
        """The next digests entry into *member*'s map, when it names blocks [first, first+count)."""
        entry = next(digests, None)
        if entry is None or entry[0] != member or entry[1] != first or len(entry[2]) != count * DIGEST:
            log.warning("%s: the journal's digests do not match its records: maps not kept", self.unit_id)
            return False
        return maps[member].write(first, entry[2])

    def _open(self, members, bs: int) -> dict[int, _Slots]:
        maps: dict[int, _Slots] = {}
        try:
            for i, m in enumerate(members):
                path = self.path(m["volume_id"])
                if m["fresh"]:
                    bm = BlockMap.create(path, bs, m["size"])
                else:
                    bm = BlockMap.open(path, writable=True)
                    bm.resize(m["size"])
                maps[i] = _Slots(bm)
        except BaseException:
            for mp in maps.values():
                mp.close(False)
            raise
        return maps

    def _record(self, generation: int, txid: str | None, volumes, block_size: int, *, durable: bool) -> None:
        """What the maps describe now. Unsynced (*durable* False), it counts only in this boot."""
        for stale in self.dir.glob("*.map"):
            if stale.stem not in volumes:
                stale.unlink(missing_ok=True)
        if durable:
            store.fsync_dir(self.dir)
            self._durable_at = time.time()
        store.write_doc(self.doc_path, {"generation": generation, "txid": txid, "block_size": block_size,
                                        "members": {v: _identity(self.layout.image(v)) for v in volumes},
                                        "durable": durable, "durable_at": self._durable_at, "boot": boot_id()},
                        durable=durable)

    def seed_from_base(self, st, base_dir: Path, meta: dict) -> bool:
        """A Demote: this site's images hold its final sync's acked generation, whose block
        maps the sender built. Copy them in, unless an image changed after that capture."""
        captured_ns = int(float(meta.get("captured_at") or 0) * 1e9)
        try:
            if any(os.stat(self.layout.image(v)).st_ctime_ns >= captured_ns - CAPTURE_SLACK_NS
                   for v in st.members):
                log.info("%s: an image changed after the final capture; its maps are not seeded", self.unit_id)
                return False
            self.invalidate()
            self.dir.mkdir(parents=True, exist_ok=True)
            for v in st.members:
                self.path(v).unlink(missing_ok=True)
                _copy_durably(self.layout.member_map(base_dir, v), self.path(v))
        except FileNotFoundError:
            return False
        self._record(st.generation, st.txid, list(st.members), st.block_size, durable=True)
        return True


def _copy_durably(src: Path, dst: Path) -> None:
    copy_map(src, dst)
    store.fsync_file(dst)


class _Slots:
    """A map's slots, gathered by 64 KiB page and written back in runs of pages, one
    ``pwritev`` a run: a 1% sync of 1 GiB writes ~2,600 single slots scattered over the map
    (half of what ``BlockMap.write`` slot by slot costs). Plain reads and writes, never a
    shared mapping, though one would be faster: a write through one into a hole, or into a block
    shared by a reflink, on a full pool is SIGBUS, and the receiver would die at every replay."""

    PAGE = 64 << 10
    MAX_PAGES = 256                # 16 MiB gathered at most

    def __init__(self, m: BlockMap):
        self.m = m
        self.end = HEADER.size + m.blocks * DIGEST
        self.pages: dict[int, bytearray] = {}

    def write(self, first: int, digests) -> bool:
        """False when the slots are not the map's (the digests do not fit the image)."""
        pos = HEADER.size + first * DIGEST
        end = pos + len(digests)
        if first < 0 or end > self.end:
            return False
        if len(digests) >= 16 * self.PAGE:       # a run (a whole record of a new image): as it is
            self.flush()
            os.pwrite(self.m.fd, digests, pos)
            return True
        src = 0
        while pos < end:
            page, rel = divmod(pos, self.PAGE)
            buf = self.pages.get(page)
            if buf is None:
                if len(self.pages) >= self.MAX_PAGES:
                    self.flush()
                buf = self.pages[page] = bytearray(os.pread(self.m.fd, self.PAGE, page * self.PAGE))
            n = min(end - pos, self.PAGE - rel)
            buf[rel:rel + n] = digests[src:src + n]
            pos += n
            src += n
        return True

    def clear(self, first: int, count: int) -> None:
        """Zero slots: written when few, punched out of the file when many."""
        count = min(count, self.m.blocks - first)
        if count <= 0:
            return
        if count * DIGEST < MAP_PAGE:
            self.write(first, bytes(count * DIGEST))
        else:
            self.flush()
            self.m.clear(first, count)

    def flush(self) -> None:
        """The gathered pages, in runs of consecutive pages (one pwritev each)."""
        run: list[bytearray] = []
        start = prev = -2
        for page in sorted(self.pages):
            if page != prev + 1 and run:
                os.pwritev(self.m.fd, run, start * self.PAGE)
                run = []
            if not run:
                start = page
            run.append(self.pages[page])
            prev = page
        if run:
            os.pwritev(self.m.fd, run, start * self.PAGE)
        self.pages.clear()

    def close(self, durable: bool) -> None:
        try:
            self.flush()
            if durable:
                os.fsync(self.m.fd)
        finally:
            self.m.close()


__all__ = ["JournalDigests", "ReplicaMaps"]
