"""The pure parts of a verify (``scrub``): its windows, the comparison of one window's
digests, and the findings it gathers (its read rate cap is ``common.read_pacer``, which the
primary's ``snaphashes`` shares)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..common.blockmap import DIGEST, block_count

WINDOW_BYTES = 32 << 20      # image bytes read under the unit's lock at a time
NAMED = 16                   # mismatched ranges a record names (the count covers every block)
REPAIR_RUNS = 1024           # mismatched runs a repair ships by name; more: a compare sync


def plan_windows(size: int, block_size: int, window_bytes: int = WINDOW_BYTES) -> list[tuple[int, int]]:
    """(first block, block count) of each window over an image of *size* bytes: whole blocks,
    at least one a window, together covering every block once."""
    per = max(1, window_bytes // block_size)
    blocks = block_count(size, block_size)
    return [(first, min(per, blocks - first)) for first in range(0, blocks, per)]


def _rows(digests: bytes) -> np.ndarray:
    return np.frombuffer(digests, dtype="<u8").reshape(-1, DIGEST // 8)


def differing(a: bytes, b: bytes) -> np.ndarray:
    """Indices of the slots whose digests differ between two runs of slots of one length."""
    if len(a) != len(b):
        raise ValueError(f"slot runs of {len(a)} and {len(b)} bytes")
    return np.flatnonzero((_rows(a) != _rows(b)).any(axis=1))


@dataclass
class Verdict:
    against_recorded: np.ndarray     # blocks (in the window) whose content is not what was applied
    against_primary: np.ndarray      # ... not the primary's snapshot of the verified generation
    rewritten: np.ndarray            # blocks a sync rewrote since the verify began: not held to the primary

    @property
    def bad(self) -> np.ndarray:
        return np.union1d(self.against_recorded, self.against_primary)


EMPTY = np.zeros(0, dtype=np.int64)


def compare_window(actual: bytes, recorded: bytes | None = None, primary: bytes | None = None,
                   start: bytes | None = None) -> Verdict:
    """One window's digests read from the image against: *recorded*, the receiver's map now;
    *primary*, the primary's map of the generation the verify began on; *start*, the
    receiver's map as the verify began, given when the unit's generation moved since (a
    block whose recorded digest changed was rewritten by a sync)."""
    rec = differing(actual, recorded) if recorded is not None else EMPTY
    if primary is None:
        return Verdict(rec, EMPTY, EMPTY)
    if start is not None and recorded is None:
        raise ValueError("a moved generation needs the recorded map to say what was rewritten")
    moved = differing(start, recorded) if start is not None else EMPTY
    pri = np.setdiff1d(differing(actual, primary), moved, assume_unique=True)
    return Verdict(rec, pri, moved)


@dataclass
class Findings:
    """What a verify found, gathered window by window: how many blocks differ, the first
    ranges (by volume, offset and what they differ from), blocks rewritten meanwhile."""
    blocks: int = 0
    skipped: int = 0
    named: list = field(default_factory=list)
    # every mismatched run, volume -> [[offset, length]], for a repair; None: too many (or a
    # member compared whole), the repair is a compare sync
    runs: dict | None = field(default_factory=dict)
    _nruns: int = 0

    def add(self, vol: str, first: int, size: int, block_size: int, v: Verdict, *,
            recorded_generation: int, primary_generation: int) -> None:
        self.skipped += len(v.rewritten)
        bad = v.bad
        self.blocks += len(bad)
        if len(bad):
            self._runs(vol, first, size, block_size, bad)
        if not len(bad) or len(self.named) >= NAMED:
            return
        rec, pri = set(v.against_recorded.tolist()), set(v.against_primary.tolist())
        for b in bad.tolist():
            against = "both" if b in rec and b in pri else ("recorded" if b in rec else "primary")
            gen = primary_generation if b in pri else recorded_generation
            off = (first + b) * block_size
            self._name(vol, off, min(block_size, size - off), against, gen)

    def _runs(self, vol: str, first: int, size: int, block_size: int, bad) -> None:
        if self.runs is None:
            return
        got = self.runs.setdefault(vol, [])
        for b in bad.tolist():
            off = (first + b) * block_size
            length = min(block_size, size - off)
            if got and got[-1][0] + got[-1][1] == off:
                got[-1][1] += length
                continue
            self._nruns += 1
            if self._nruns > REPAIR_RUNS:
                self.runs = None
                return
            got.append([off, length])

    def whole(self, vol: str, size: int, block_size: int, against: str, generation: int, reason: str) -> None:
        """A member that cannot be compared block by block (absent, or of another size)."""
        self.blocks += max(1, block_count(size, block_size))
        self.runs = None
        self.named.append({"volume": vol, "offset": 0, "length": size, "against": against,
                           "generation": generation, "reason": reason})

    def _name(self, vol: str, off: int, length: int, against: str, generation: int) -> None:
        last = self.named[-1] if self.named else None
        if last and (last["volume"], last["against"], last["offset"] + last["length"]) == (vol, against, off):
            last["length"] += length
        elif len(self.named) < NAMED:
            self.named.append({"volume": vol, "offset": off, "length": length, "against": against,
                               "generation": generation})
