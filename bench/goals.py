"""Issue 9's benchmark goals, judged from the bench's JSON line, and the figures as a table.

    python -m bench.delta_vs_rsync --json | tail -1 > cold.json
    python -m bench.delta_vs_rsync --json --warm --cases 1pct | tail -1 > warm.json
    python -m bench.goals cold.json [warm.json]

Each goal is (name, measured text, met?); a goal whose case was not run is left out.
"""
from __future__ import annotations

import json
import sys

from .ceilings import channel_text, extents_text

MB = 1e6
RSS_LIMIT = 150 * MB


def _med(c, key):
    return c[key]["median"] if c.get(key) else None


def _kernel(c) -> str:
    """What the kernel work of a delta case costs on this machine (bench/ceilings.py)."""
    ec = c.get("extent_costs")
    return f" [{extents_text(ec)}]" if ec else ""


def _near_floor(cases: dict, name: str, cold: bool) -> list:
    c = cases.get(name)
    if not (c and cold and c.get("floor_s")):
        return []
    d, f = _med(c, "drsvc_s"), _med(c, "floor_s")
    return [(f"{name} cold: <= 1.5 x floor_s + 50 ms", f"{d:.3f} s vs {1.5 * f + 0.05:.3f} s "
             f"(floor {f:.3f} s){_kernel(c)}", d <= 1.5 * f + 0.05),
            (f"{name}: wire <= 1.05 x changed", f"{c['drsvc_wire_bytes'] / c['changed_bytes']:.3f} x",
             c["drsvc_wire_bytes"] <= 1.05 * c["changed_bytes"])]


def _speeds(cases: dict, cold: bool) -> list:
    """Beside rsync (1pct warm, 10pct, full), full's rate, and the thin case."""
    out = []
    if (c := cases.get("1pct")) and not cold and c.get("ratio"):
        out.append(("1pct warm: >= 12 x rsync", f"{c['ratio']:.1f} x", c["ratio"] >= 12))
    if (c := cases.get("10pct")) and c.get("ratio"):
        out.append(("10pct: >= 6 x rsync", f"{c['ratio']:.1f} x{_kernel(c)}", c["ratio"] >= 6))
        runs = c["drsvc_s"]["runs"]
        if len(runs) >= 3:
            out.append(("10pct: run 3 <= 1.2 x run 1", f"{runs[2]:.3f} s vs {runs[0]:.3f} s",
                        runs[2] <= 1.2 * runs[0]))
    if (c := cases.get("full")) and c.get("ratio"):
        mbs = c["changed_bytes"] / _med(c, "drsvc_s") / MB
        out.append(("full: >= 2 x rsync", f"{c['ratio']:.2f} x", c["ratio"] >= 2))
        ch = c.get("channel")
        alone = f" ({channel_text(ch)})" if ch else ""
        out.append(("full: >= 400 MB/s", f"{mbs:.0f} MB/s{alone}", mbs >= 400))
    if c := cases.get("thin"):
        out.append(("thin: <= 0.5 s", f"{_med(c, 'drsvc_s'):.3f} s", _med(c, "drsvc_s") <= 0.5))
    return out


def _idles_and_freezes(cases: dict) -> list:
    out = []
    for name in ("idle", "idle_celery"):
        if c := cases.get(name):
            out.append((f"{name}: <= 30 ms", f"{_med(c, 'drsvc_s') * 1000:.0f} ms", _med(c, "drsvc_s") <= 0.030))
    for name in ("full", "1pct", "10pct", "thin", "aged", "idle", "many"):
        if c := cases.get(name):
            ph = c.get("drsvc_phases") or []
            worst = max((p.get("freeze_s", 0.0) for p in ph), default=0.0)
            out.append((f"{name}: freeze <= 100 ms", f"{worst * 1000:.0f} ms (worst run)", worst <= 0.1))
    return out


def judge(doc: dict) -> list[tuple[str, str, bool]]:
    cases = {c["name"]: c for c in doc["cases"]}
    cold = doc.get("cold", True)
    out = _near_floor(cases, "1pct", cold) + _speeds(cases, cold) + _near_floor(cases, "aged", cold)
    out += _idles_and_freezes(cases)
    rss = doc.get("peak_rss_bytes") or {}
    if rss:
        out.append(("peak RSS < 150 MB (sender, receiver)",
                    f"{rss['sender'] / MB:.0f} MB, {rss['receiver'] / MB:.0f} MB",
                    max(rss["sender"], rss["receiver"]) < RSS_LIMIT))
    return out


def table(doc: dict) -> str:
    """case | drsvc median | rsync median | ratio | floor | wire | phases | RSS, one row per case."""
    rows = ["| case | drsvc median | rsync median | ratio | floor median | changed | drsvc wire | "
            "phase medians | peak RSS sender / receiver |", "|---|---|---|---|---|---|---|---|---|"]
    for c in doc["cases"]:
        def s(key, c=c):
            v = _med(c, key)
            return f"{v:.3f} s" if v is not None else "-"
        ph = ", ".join(f"{k[:-2]} {v:.3f}" for k, v in c.get("drsvc_phases_median", {}).items())
        rss = c.get("peak_rss_bytes") or {}
        rows.append(f"| {c['name']} | {s('drsvc_s')} | {s('rsync_s')} | {c.get('ratio') or '-'} | {s('floor_s')} | "
                    f"{c['changed_bytes'] / 2**20:.2f} MiB | {c['drsvc_wire_bytes'] / 2**20:.2f} MiB | {ph} | "
                    f"{rss.get('sender', 0) / 2**20:.0f} / {rss.get('receiver', 0) / 2**20:.0f} MiB |")
    return "\n".join(rows)


def main(argv=None) -> int:
    paths = (argv if argv is not None else sys.argv[1:]) or ["/dev/stdin"]
    for path in paths:
        with open(path) as f:
            doc = json.loads(f.read().strip().splitlines()[-1])
        print(f"## {path} ({'cold' if doc.get('cold') else 'warm'}, load {doc.get('loadavg')})")
        print(table(doc))
        for name, got, ok in judge(doc):
            print(f"- {'MET    ' if ok else 'NOT MET'} {name}: {got}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
