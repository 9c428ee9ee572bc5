"""The sender's snapshot store: the acked base, a pending generation, and adoption.

    snap/<G>/          the acked base: whole images (or, cut short mid-adopt, overlays
                       not yet rolled in), block maps, meta.json
    snap/<G+1>/        pending: captured, planned and maybe on the wire
    snap/tmp-<txid>/   being prepared (``prepare``); swept by the next sync

Every function is safe to repeat, and the order of side effects makes a retry
converge: the rename to ``snap/<G+1>`` records the intent before anything is
sent; ``adopt`` records the new generation in state.json, then rolls the base
forward, then drops the old base (``ensure_whole_base`` finishes an adopt cut short).

A worker's sync returns once the generation is recorded: the roll and the old base's
removal go on behind it on a thread (``roll_behind``), under the unit's roll lock
(``PoolLayout.roll_lock_path``), and nothing else. Whatever reads the base next waits for
that lock first (``ensure_whole_base``: the next sync's sweep, a verify, a generation's
image), so the peer's answer is not held back by a local rename and a cold roll. The
roller takes no other lock, so waiting for it cannot deadlock.

Rolling the base forward is one FICLONERANGE per range the generation changed (2,600 for
1% of 1 GiB: 0.1 s). ``Preroll`` does it while the peer commits (from the trailer on), into a
reflink of the base (``<vol>.img.next`` beside the overlay; the base itself is untouched
until the peer commits), so the adopt only renames it in. A generation never adopted takes
its ``.next`` with it when it is dropped; an adopt that finds none rolls the base in place.
The reflink of the whole base costs per extent of it (``worth_rolling_ahead``).
"""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import threading
import time
from pathlib import Path

from ... import schedule_changes, store
from ...errors import CorruptMetadata
from ...host.reflink import clone_file
from ...layout import PoolLayout
from ..common.replica_maps import ReplicaMaps
from ..common.unit_state import UnitState, save_state
from .capture import overlay_counts, roll_forward
from .generation import Prepared

log = logging.getLogger(__name__)


def _rmtree(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)
        store.fsync_dir(path.parent)


def base_meta(layout: PoolLayout, unit_id: str, generation: int) -> dict:
    """meta.json of the acked base generation ({} before the first sync)."""
    if generation <= 0:
        return {}
    return store.read_doc(layout.snap_dir(unit_id, generation) / "meta.json") or {}


def load_pending(layout: PoolLayout, unit_id: str, acked: int) -> Prepared | None:
    d = layout.snap_dir(unit_id, acked + 1)
    meta = store.read_doc(d / "meta.json")
    if meta is None or not meta.get("complete"):
        return None
    return Prepared(d, meta)


def sweep(layout: PoolLayout, unit_id: str, acked: int, pending: Prepared | None) -> None:
    """Remove snapshot dirs that are neither the acked base nor the pending generation."""
    ensure_whole_base(layout, unit_id, acked)
    keep = {str(acked)} | ({str(acked + 1)} if pending else set())
    root = layout.snap_root(unit_id)
    if not root.exists():
        return
    for child in root.iterdir():
        if child.name not in keep:
            shutil.rmtree(child, ignore_errors=True)


def mark_intent(layout: PoolLayout, unit_id: str, prepared: Prepared) -> Prepared:
    """Move a prepared generation to ``snap/<G+1>``: from here on it may exist at the peer."""
    meta = prepared.meta
    if prepared.dir.name == str(meta["generation"]):
        return prepared
    final = layout.snap_dir(unit_id, meta["generation"])
    if final.exists():
        shutil.rmtree(final)
    os.rename(prepared.dir, final)
    store.fsync_dir(final.parent)
    return Prepared(final, meta)


PREROLLED = ".img.next"      # a member's whole image at the pending generation, rolled ahead
_PREROLLING = ".img.part"    # being rolled (dropped if found: a roll cut short)


# The preroll's reflink of the whole base costs per extent of it, the roll per range changed
# (a range costs about as much as a couple of extents): on an aged image with few ranges
# changed, rolling ahead costs more than rolling in place after the answer, and is not hidden
# behind the answer. Past this many extents per range changed the adopt rolls the base in
# place; below PREROLL_SMALL extents in all (a reflink of a few ms) the base is rolled ahead
# whatever changed. A higher floor makes an idle sync (a few ranges) of an image of some
# thousands of extents wait for a roll longer than its answer on a LAN.
PREROLL_EXTENTS_PER_RANGE = 8
PREROLL_SMALL = 256


def worth_rolling_ahead(gen_dir: Path, vol: str) -> bool:
    try:
        ranges, extents = overlay_counts(gen_dir, vol)
    except FileNotFoundError:
        return False
    return extents is not None and extents <= max(PREROLL_SMALL, PREROLL_EXTENTS_PER_RANGE * ranges)


def _overlays_to_roll(gen_dir: Path, meta: dict):
    return [m for m in meta["members"] if m.get("overlay") and not (gen_dir / f"{m['volume_id']}.img").exists()]


def to_roll_ahead(gen_dir: Path, meta: dict) -> list[dict]:
    """The overlay members of a pending generation worth rolling ahead and not rolled yet."""
    return [m for m in _overlays_to_roll(gen_dir, meta)
            if not (gen_dir / f"{m['volume_id']}{PREROLLED}").exists() and worth_rolling_ahead(gen_dir, m["volume_id"])]


def preroll(layout: PoolLayout, unit_id: str, gen_dir: Path, meta: dict, members: list[dict]) -> None:
    """Roll *members* (``to_roll_ahead``) of a pending generation forward into a reflink of
    their base (``<vol>.img.next``), leaving the base as it is. Repeat-safe."""
    base_dir = layout.snap_dir(unit_id, meta["base_generation"])
    for m in members:
        vol = m["volume_id"]
        done, part = gen_dir / f"{vol}{PREROLLED}", gen_dir / f"{vol}{_PREROLLING}"
        part.unlink(missing_ok=True)
        try:
            clone_file(base_dir / f"{vol}.img", part, fsync=False)
            roll_forward(part, gen_dir, vol, m["size"])     # ends with its fsync
            os.rename(part, done)
        except BaseException:
            part.unlink(missing_ok=True)
            raise


class Preroll:
    """``preroll`` on a thread, started (``start``, once) at the trailer, while the peer commits.
    ``join`` before the generation is adopted or dropped; a failed preroll only leaves the
    adopt its old way (roll the base in place)."""

    def __init__(self, layout: PoolLayout, unit_id: str, gen_dir: Path, meta: dict):
        self._args = (layout, unit_id, gen_dir, meta)
        self._thread = None
        self.seconds = 0.0       # the thread's time (the ranges' reflinks, off the sync's path)

    def start(self) -> None:
        """Roll ahead what is worth it, as the capture left it (an early plan's capture ends
        after its first records left: ``capture_feed``)."""
        if self._thread is not None or self._args is None:
            return
        layout, unit_id, gen_dir, meta = self._args
        self._args = None
        members = to_roll_ahead(gen_dir, meta)
        if members:
            self._thread = threading.Thread(target=self._run, args=(layout, unit_id, gen_dir, meta, members),
                                            name=f"preroll-{unit_id}", daemon=True)
            self._thread.start()

    def _run(self, layout: PoolLayout, unit_id: str, gen_dir: Path, meta: dict, members: list[dict]) -> None:
        t = time.monotonic()
        try:
            preroll(layout, unit_id, gen_dir, meta, members)
        except Exception as e:   # noqa: BLE001 - the adopt rolls the base in place instead
            log.warning("%s: generation %s not rolled ahead (%s); the adopt rolls it", unit_id,
                        meta.get("generation"), e)
        self.seconds = time.monotonic() - t

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
        self._thread = None
        self._args = None


def _roll(layout: PoolLayout, unit_id: str, gen_dir: Path, meta: dict) -> None:
    """Give every overlay member of an adopted generation its whole image: the one rolled
    ahead (``preroll``), else the base image rolled forward in place, then moved in.
    Repeat-safe (see ensure_whole_base)."""
    base_dir = layout.snap_dir(unit_id, meta["base_generation"])
    renamed = moved = False          # a rolled-ahead image renamed in; a base image moved out
    for m in _overlays_to_roll(gen_dir, meta):
        vol = m["volume_id"]
        if (gen_dir / f"{vol}{PREROLLED}").exists():
            os.rename(gen_dir / f"{vol}{PREROLLED}", gen_dir / f"{vol}.img")
            renamed = True
            continue
        base_img = base_dir / f"{vol}.img"
        if not base_img.exists():
            raise CorruptMetadata(path=str(gen_dir), reason=f"base image of overlay member {vol} is gone")
        roll_forward(base_img, gen_dir, vol, m["size"])
        os.rename(base_img, gen_dir / f"{vol}.img")
        moved = True
    if renamed or moved:
        store.fsync_dir(gen_dir)
    if moved:
        store.fsync_dir(base_dir)
    for m in meta["members"]:
        for suffix in (".delta", ".ranges", ".clear", PREROLLED, _PREROLLING):
            (gen_dir / f"{m['volume_id']}{suffix}").unlink(missing_ok=True)


def ensure_whole_base(layout: PoolLayout, unit_id: str, acked: int) -> None:
    """The acked base *acked* with every member's whole image, before it is read: a roll
    still running behind an earlier sync's return is waited for (``roll_behind``), and an
    adopt cut short between recording the generation and rolling its base is finished."""
    if acked <= 0 or not layout.unit_dir(unit_id).is_dir():
        return
    with store.file_lock(layout.roll_lock_path(unit_id), key=unit_id):
        d = layout.snap_dir(unit_id, acked)
        meta = store.read_doc(d / "meta.json")
        if meta and any(m.get("overlay") and not (d / f"{m['volume_id']}.img").exists()
                        for m in meta["members"]):
            log.warning("%s: finishing the adopt of generation %d", unit_id, acked)
            _roll(layout, unit_id, d, meta)


def wait_for_roll(layout: PoolLayout, unit_id: str) -> None:
    """Until no roll runs behind a sync's return (the unit's roll lock is free)."""
    if layout.unit_dir(unit_id).is_dir():
        with store.file_lock(layout.roll_lock_path(unit_id), key=unit_id):
            pass


_BEHIND: set[threading.Thread] = set()


def roll_behind(layout: PoolLayout, unit_id: str, gen_dir: Path, meta: dict, old: int, rolling: Preroll) -> None:
    """The rest of an adopt (the preroll joined, the base rolled in, the old base dropped)
    on a thread, under the unit's roll lock, taken here before the caller returns. A
    failure leaves it to the next ``ensure_whole_base``; so does a process that exits
    under it, though one that exits normally finishes its rolls first."""
    lock = store.file_lock(layout.roll_lock_path(unit_id), key=unit_id)
    lock.__enter__()

    def run() -> None:
        try:
            rolling.join()
            _roll(layout, unit_id, gen_dir, meta)
            if old != meta["generation"]:
                _rmtree(layout.snap_dir(unit_id, old))
        except Exception as e:  # noqa: BLE001 - the next reader of the base finishes it
            log.warning("%s: generation %s not rolled in after the sync (%s); the next sync rolls it",
                        unit_id, meta.get("generation"), e)
        finally:
            lock.__exit__(None, None, None)
            _BEHIND.discard(thread)
    thread = threading.Thread(target=run, name=f"roll-{unit_id}", daemon=True)
    _BEHIND.add(thread)
    thread.start()


@atexit.register
def _finish_rolls() -> None:
    for t in list(_BEHIND):
        t.join()


def adopt(layout: PoolLayout, st: UnitState, prepared: Prepared, *, epoch: int, peer_name: str,
          demote: bool = False, report: dict | None = None, behind: Preroll | None = None) -> None:
    """Record that the peer holds the prepared generation; it becomes the new base.
    *behind*: the generation's preroll, still running; the base then rolls forward after
    the return (``roll_behind``). A demote rolls it before, as its block maps come from it."""
    meta = prepared.meta
    old = st.generation
    st.generation = meta["generation"]
    st.txid = meta["txid"]
    st.members = [m["volume_id"] for m in meta["members"]]
    st.sizes = {m["volume_id"]: m["size"] for m in meta["members"]}
    st.block_size = meta["block_size"]
    st.epoch = max(st.epoch, epoch)
    st.peer = peer_name
    if demote:
        st.role, st.demoted, st.demoted_at = "secondary", True, st.generation
    if report is not None:
        st.add_report(report)
    save_state(layout.root, st)
    if demote:          # no longer primary here: the scheduler drops it
        schedule_changes.mark(layout.root, st.unit_id)
    if behind is not None and not demote:
        roll_behind(layout, st.unit_id, prepared.dir, meta, old, behind)
        return
    if behind is not None:
        behind.join()
    _roll(layout, st.unit_id, prepared.dir, meta)
    if old != st.generation:
        _rmtree(layout.snap_dir(st.unit_id, old))
    if demote and not meta.get("sources"):
        # this site now receives: its images hold this generation, whose maps were just built
        try:
            ReplicaMaps(layout, st.unit_id).seed_from_base(st, prepared.dir, meta)
        except OSError as e:
            log.warning("%s: block maps not seeded at the demote (%s); a promote here reads the volume",
                        st.unit_id, e)


def generation_image(layout: PoolLayout, unit_id: str, generation: int, vol: str, scratch: Path) -> Path:
    """A whole image of *vol* at a kept generation (the acked base or the pending one):
    the file itself, or for a pending overlay a reflink of the base rolled forward
    into *scratch*."""
    wait_for_roll(layout, unit_id)
    d = layout.snap_dir(unit_id, generation)
    if (d / f"{vol}.img").exists():
        return d / f"{vol}.img"
    meta = store.read_doc(d / "meta.json") or {}
    m = next(x for x in meta.get("members", []) if x["volume_id"] == vol)
    out = Path(scratch) / f"{vol}.img"
    clone_file(layout.snap_dir(unit_id, meta["base_generation"]) / f"{vol}.img", out, fsync=False)
    roll_forward(out, d, vol, m["size"])
    return out


def release_unit(pool, unit_id: str) -> bool:
    """Forget the local replication state of a unit (snapshots, maps, state.json)."""
    layout = PoolLayout(pool)
    d = layout.unit_dir(unit_id)
    if not d.exists():
        return False
    with store.file_lock(layout.lock_path(unit_id), blocking=False, key=unit_id), \
            store.file_lock(layout.roll_lock_path(unit_id), key=unit_id):
        store.remove(layout.state_path(unit_id))
        for child in d.iterdir():
            if child.name != ".lock":
                if child.is_dir():
                    shutil.rmtree(child)
                else:
                    child.unlink()
    shutil.rmtree(d, ignore_errors=True)
    schedule_changes.mark(pool, unit_id)
    return True
