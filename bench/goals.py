"""The bench's goals, judged from its JSON line, and the figures as a table.

    python -m bench.delta_vs_rsync --json | tail -1 > cold.json
    python -m bench.delta_vs_rsync --json --warm --cases 1pct | tail -1 > warm.json
    python -m bench.delta_vs_rsync --json --link rtt=100ms,rate=1gbit --full-mib 1024 | tail -1 > wan.json
    python -m bench.goals cold.json [warm.json] [wan.json]
    python -m bench.goals --summary wan-50ms.json wan-100ms.json wan-200ms.json

A run over a link (its JSON has "link") is judged by the WAN goals, each against
its floor over the link (wire bytes / rate + 1 RTT, bench/wan.py); a run without,
by the LAN goals. Freeze and peak RSS are judged in both. Each goal is (name, measured
text, met?); a goal whose case was not run is left out.
"""
from __future__ import annotations

import json
import sys

from .texts import channel_text, extents_text, wan_ceilings_text

MB = 1e6
MiB = 1 << 20
RSS_LIMIT = 150 * MB


def _med(c, key):
    return c[key]["median"] if c.get(key) else None


def _kernel(c) -> str:
    """What the kernel work of a delta case costs on this machine (bench/ceilings.py)."""
    ec = c.get("extent_costs")
    return f" [{extents_text(ec)}]" if ec else ""


def judge(doc: dict) -> list[tuple[str, str, bool]]:
    cases = {c["name"]: c for c in doc["cases"]}
    out = judge_wan(cases, doc["link"]) if doc.get("link") else judge_lan(cases, doc.get("cold", True))
    return out + judge_always(cases, doc)


def judge_wan(cases: dict, link: dict) -> list[tuple[str, str, bool]]:
    """The WAN goals: bulk data at >= 85% of the link rate; 1% within 1.2 x its floor; an idle
    sync within floor + 1 RTT; a planned failover within floor + 2 RTT; the compressible
    pages below their uncompressed floor."""
    out = []
    rtt, rate = link["rtt_s"], link["rate_bytes_s"]

    def figures(c):
        return _med(c, "drsvc_s"), c["link"]["floor_s"]["median"]
    if (c := cases.get("full")) and rate:
        got = c["changed_bytes"] / _med(c, "drsvc_s")
        wc = c.get("wan_ceilings")
        out.append(("full: >= 85% of the link rate", f"{got / MiB:.1f} MiB/s = {got / rate:.0%} of "
                    f"{rate / MiB:.1f} MiB/s (floor {c['link']['floor_s']['median']:.3f} s)"
                    + (f" [{wan_ceilings_text(wc)}]" if wc else ""), got >= 0.85 * rate))
    if c := cases.get("1pct"):
        d, f = figures(c)
        disk = f"; the changed blocks read cold here: {_med(c, 'floor_s'):.3f} s" if c.get("floor_s") else ""
        out.append(("1pct: <= 1.2 x floor", f"{d:.3f} s vs {1.2 * f:.3f} s (floor {f:.3f} s, {d / f:.2f} x{disk})",
                    d <= 1.2 * f))
    for name, extra in (("idle", 1), ("failover", 2)):
        if c := cases.get(name):
            d, f = figures(c)
            out.append((f"{name}: <= floor + {extra} RTT", f"{d:.3f} s vs {f + extra * rtt:.3f} s "
                        f"(floor {f:.3f} s, {(d - f) / rtt:.1f} RTT over it)" if rtt else f"{d:.3f} s",
                        d <= f + extra * rtt))
    if c := cases.get("dbpages"):
        d, raw = _med(c, "drsvc_s"), c["link"]["data_floor_s"]["median"]
        out.append(("dbpages: < the uncompressed floor", f"{d:.3f} s vs {raw:.3f} s (changed / rate + RTT; "
                    f"wire {c['drsvc_wire_bytes'] / c['changed_bytes']:.2f} x changed)", d < raw))
    return out


def judge_lan(cases: dict, cold: bool) -> list[tuple[str, str, bool]]:
    """The LAN goals (no --link)."""
    out = []

    def near_floor(name):
        c = cases.get(name)
        if c and cold and c.get("floor_s"):
            d, f = _med(c, "drsvc_s"), _med(c, "floor_s")
            out.append((f"{name} cold: <= 1.5 x floor_s + 50 ms", f"{d:.3f} s vs {1.5 * f + 0.05:.3f} s "
                        f"(floor {f:.3f} s){_kernel(c)}", d <= 1.5 * f + 0.05))
            out.append((f"{name}: wire <= 1.05 x changed", f"{c['drsvc_wire_bytes'] / c['changed_bytes']:.3f} x",
                        c["drsvc_wire_bytes"] <= 1.05 * c["changed_bytes"]))
    near_floor("1pct")
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
    near_floor("aged")
    for name in ("idle", "idle_celery"):
        if c := cases.get(name):
            out.append((f"{name}: <= 30 ms", f"{_med(c, 'drsvc_s') * 1000:.0f} ms", _med(c, "drsvc_s") <= 0.030))
    return out


def judge_always(cases: dict, doc: dict) -> list[tuple[str, str, bool]]:
    """Freeze and peak RSS: the same on any link."""
    out = []
    for name in ("full", "1pct", "10pct", "thin", "aged", "idle", "many", "dbpages"):
        if c := cases.get(name):
            ph = c.get("drsvc_phases") or []
            worst = max((p.get("freeze_s", 0.0) for p in ph), default=0.0)
            out.append((f"{name}: freeze <= 100 ms", f"{worst * 1000:.0f} ms (worst run)", worst <= 0.1))
    rss = doc.get("peak_rss_bytes") or {}
    if rss:
        out.append(("peak RSS < 150 MB (sender, receiver)",
                    f"{rss['sender'] / MB:.0f} MB, {rss['receiver'] / MB:.0f} MB",
                    max(rss["sender"], rss["receiver"]) < RSS_LIMIT))
    return out


def wan_table(doc: dict) -> str:
    """Over a link: case | drsvc median | floor | x floor | data floor | rsync | rsync x floor | ..."""
    rows = [f"| case ({doc['link']['spec']}) | drsvc median | floor (wire / rate + RTT) | x floor | data floor "
            "(changed / rate + RTT) | rsync median | rsync x floor | changed | drsvc wire | phase medians |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for c in doc["cases"]:
        lk = c.get("link") or {}
        rs = _med(c, "rsync_s")
        ph = ", ".join(f"{k[:-2]} {v:.3f}" for k, v in c.get("drsvc_phases_median", {}).items())
        rows.append(f"| {c['name']} | {_med(c, 'drsvc_s'):.3f} s | {lk['floor_s']['median']:.3f} s | "
                    f"{lk['x_floor']:.2f} | {lk['data_floor_s']['median']:.3f} s | "
                    f"{f'{rs:.3f} s' if rs is not None else '-'} | {lk.get('rsync_x_floor') or '-'} | "
                    f"{c['changed_bytes'] / MiB:.2f} MiB | {c['drsvc_wire_bytes'] / MiB:.2f} MiB | {ph} |")
    return "\n".join(rows)


def table(doc: dict) -> str:
    """case | drsvc median | rsync median | ratio | floor | wire | phases | RSS, one row per case."""
    if doc.get("link"):
        return wan_table(doc)
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


def summary(docs: list[dict]) -> str:
    """Runs over several links in one table: link | case | drsvc | floor | x floor | rsync | rsync x floor."""
    rows = ["| link | case | drsvc median | floor (wire / rate + RTT) | x floor | rsync median | rsync x floor |",
            "|---|---|---|---|---|---|---|"]
    for doc in docs:
        link = doc["link"]
        for i, c in enumerate(doc["cases"]):
            lk, d, rs = c["link"], _med(c, "drsvc_s"), _med(c, "rsync_s")
            what = c["name"] + (f" ({c['changed_bytes'] / d / MiB:.1f} MiB/s)" if c["name"] == "full" else "")
            rows.append(f"| {link['spec'] if i == 0 else ''} | {what} | {d:.3f} s | {lk['floor_s']['median']:.3f} s | "
                        f"{lk['x_floor']:.2f} | {f'{rs:.3f} s' if rs is not None else '-'} | "
                        f"{lk.get('rsync_x_floor') or '-'} |")
    return "\n".join(rows)


def _load(path: str) -> dict:
    with open(path) as f:
        return json.loads(f.read().strip().splitlines()[-1])


def main(argv=None) -> int:
    paths = (argv if argv is not None else sys.argv[1:]) or ["/dev/stdin"]
    if paths[0] == "--summary":          # runs over links, one table
        print(summary([_load(p) for p in paths[1:]]))
        return 0
    for path in paths:
        doc = _load(path)
        link = f", link {doc['link']['spec']}" if doc.get("link") else ""
        print(f"## {path} ({'cold' if doc.get('cold') else 'warm'}{link}, load {doc.get('loadavg')})")
        print(table(doc))
        for name, got, ok in judge(doc):
            print(f"- {'MET    ' if ok else 'NOT MET'} {name}: {got}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
