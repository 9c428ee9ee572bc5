"""The demo's per-sync table at the 120 columns a pipe gets."""
import re

from rich.console import Console

from drsvc_lab.demo import view as demo_view

MiB = 1 << 20


def _rows(syncs: int, seconds: float) -> list[dict]:
    labels = ("load: 128 MiB of pages", "commits: +4 MiB log, 512 pages",
              "checkpoint: +1 MiB log, 2048 pages")
    return [{"label": lab, "syncs": syncs, "app_bytes": 130 * MiB, "bytes_changed": 129 * MiB,
             "bytes_on_wire": 128 * MiB, "seconds": seconds,
             "rsync": {"bytes_sent": 140 * MiB, "seconds": seconds * 2}} for lab in labels]


def test_rows_that_took_in_scheduled_syncs_wrap_their_label_and_keep_every_figure():
    """On a loaded machine scheduled syncs land during the bursts, the labels grow by
    "(N syncs)", and the durations by a minute field. At 120 columns, the label wraps and
    no figure is cut. This failed CI once: rich cut the ratio column to "1." when the label
    could not wrap."""
    for syncs, seconds in ((1, 0.45), (3, 72.3), (12, 3725.0)):
        con = Console(width=120, force_terminal=False, record=True)
        con.print(demo_view.sync_table(_rows(syncs, seconds), rsync=True))
        out = con.export_text()
        lines = out.splitlines()
        assert max(len(ln) for ln in lines) <= 120, out
        assert "…" not in out, out
        assert sum(1 for ln in lines if re.search(r"MiB .* MiB .* MiB .*\d+\.\d+x", ln)) == 3, out
