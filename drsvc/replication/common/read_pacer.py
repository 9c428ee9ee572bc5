"""A read rate cap, shared by a verify's reads of the replica (``control.scrub``) and the
primary's reads of its acked snapshot for that verify (``receiver.verbs.snapshot_hashes``)."""
from __future__ import annotations

import time


class ReadPacer:
    """A read rate cap: after each read, how long to wait so that the reads so far average at
    most *rate* bytes per second since the first (0: no cap). Holes are not reads."""

    def __init__(self, rate: float, clock=time.monotonic):
        self.rate = float(rate or 0)
        self.clock = clock
        self.start = clock()
        self.done = 0

    def delay(self, nbytes: int) -> float:
        self.done += int(nbytes)
        if self.rate <= 0:
            return 0.0
        return max(0.0, self.start + self.done / self.rate - self.clock())
