"""One-line texts of the ceilings and link figures, shared by the bench's report (harness)
and bench.goals (kept apart from bench.ceilings, which measures them)."""
from __future__ import annotations

MiB = 1 << 20


def channel_text(ch: dict) -> str:
    """One line of a ``channel`` result (JSON lines written before disk_write lack it)."""
    disk = f"; the peer's pool writes {ch['disk_write_mb_s']:.0f} MB/s" if "disk_write_mb_s" in ch else ""
    return f"an SSH channel alone: {ch['drsvc_mb_s']:.0f} MB/s drsvc's, {ch['openssh_mb_s']:.0f} MB/s OpenSSH's{disk}"


def extents_text(ec: dict) -> str:
    """One line of an ``extent_costs`` result."""
    per = (f", {ec['ranges_cloned']} ranges cloned at <= {ec['precopy_us_per_range']:.0f} us (capture) and "
           f"{ec['adopt_us_per_range']:.0f} us (the base roll) each" if "adopt_us_per_range" in ec else "")
    return f"image of {ec['extents']} extents, one FIEMAP {ec['fiemap_s']:.3f} s{per}"


def link_text(lk: dict) -> str:
    """One line of a case's ``link`` figures: its floors and the ratios to them."""
    rs = f", rsync {lk['rsync_x_floor']:.2f} x" if lk.get("rsync_x_floor") else ""
    return (f"link floor {lk['floor_s']['median']:.3f} s (wire / rate + RTT; data floor "
            f"{lk['data_floor_s']['median']:.3f} s) -> drsvc {lk['x_floor']:.2f} x floor{rs}")


def wan_ceilings_text(wc: dict) -> str:
    """One line of the ``wan_ceilings`` measured beside ``full`` over the link."""
    link = wc["link_mib_s"]

    def share(v):
        return f"{v:.1f} MiB/s" + (f" ({v / link:.0%})" if link else "")
    chans = ", ".join(f"{n} channel{'s' if n != '1' else ''} {share(v)}" for n, v in wc["paramiko_mib_s"].items())
    rate = f"{link:.1f} MiB/s" if link else "unlimited"
    return f"the link {rate}: the emulator alone (raw TCP) {share(wc['emulator_mib_s'])}; paramiko to a sink: {chans}"
