"""Print the headline figures of ``bench/results/*.json`` as a Markdown table (for README.md).

    python -m bench.summary
"""

from __future__ import annotations

import json
import sys
from typing import Any

from bench.common import RESULTS_DIR, fmt

ORDER = ("codec", "grouping", "pipeline", "inprocess", "latency", "trainer", "memory", "server")


def load(name: str) -> dict[str, Any] | None:
    path = RESULTS_DIR / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def table(results: dict[str, Any], title_start: str) -> list[dict[str, Any]]:
    return next(rows for title, rows in results["tables"].items() if title.startswith(title_start))


def headline(name: str, r: dict[str, Any]) -> list[str]:
    """One Markdown row per figure: | benchmark | figure | value | anchor / target |."""
    rows: list[str] = []
    if name == "codec":
        by = {(x["case"], x["method"]): x for x in table(r, "Encode/decode")}
        for case in ("episode", "batch"):
            ours, pick, copy = by[(case, "rollstream")], by[(case, "pickle-5")], by[(case, "memcpy (copyto)")]
            rows.append(f"| codec | {case} encode / decode, µs | {fmt(ours['enc_us'])} / {fmt(ours['dec_us'])} | "
                        f"pickle-5 {fmt(pick['enc_us'])} / {fmt(pick['dec_us'])}; memcpy {fmt(copy['enc_us'])} |")
    if name == "grouping":
        for row in table(r, "Gather"):
            rows.append(f"| grouping | {row['path']}, episodes/s | {fmt(row['episodes/s'])} | {fmt(row['x floor time'])}x the pad_sequence time |")
    if name == "pipeline":
        for row in table(r, "Broker path"):
            extra = f"; {fmt(row['episodes/s'])} episodes/s, {fmt(row['tokens/s (generated)'])} tokens/s" if "episodes/s" in row and row.get("episodes/s") == row.get("episodes/s") else ""
            rows.append(f"| pipeline | {row['path']}, MB/s through the broker | {fmt(row['through MB/s'])} | "
                        f"{fmt(row['CPU ms/MB'])} CPU-ms/MB{extra} |")
    if name == "inprocess":
        row = table(r, "In-process")[0]
        rows.append(f"| inprocess | in-process executor, episodes/s | {fmt(row['episodes/s'])} | "
                    f"{fmt(row['tokens/s (generated)'])} tokens/s, {fmt(row['CPU ms/episode'])} CPU-ms/episode |")
        cost = next((t for t in r["tables"] if t.startswith("What durability")), None)
        if cost:
            c = r["tables"][cost][-1]
            rows.append(f"| inprocess | cost of durability per episode | {fmt(c['wall ms/episode'])} ms wall, "
                        f"{fmt(c['CPU ms/episode'])} CPU-ms | pipeline minus in-process |")
    if name == "latency":
        for row in table(r, "Group-to-trainer"):
            rows.append(f"| latency | commit interval {row['commit_interval_ms']} ms: p50 / p95 / p99 ms | "
                        f"{fmt(row['p50'])} / {fmt(row['p95'])} / {fmt(row['p99'])} | max {fmt(row['max'])} |")
    if name == "trainer":
        for row in table(r, "Commit-to-rank"):
            rows.append(f"| trainer | {row['ranks']} rank(s): commit to arrival on its rank, p50 / p99 ms | "
                        f"{fmt(row['p50'])} / {fmt(row['p99'])} | max {fmt(row['max'])}; {row['groups']} groups |")
    if name == "memory":
        buf = table(r, "GroupBuffer")
        rows.append(f"| memory | GroupBuffer RSS after {buf[0]['emitted groups']:,} / {buf[-1]['emitted groups']:,} emitted groups, MB | "
                    f"{fmt(buf[0]['RSS MB'])} / {fmt(buf[-1]['RSS MB'])} | {buf[-1]['open groups']} open, {buf[-1]['outcomes kept']} outcomes kept |")
        for row in r["extra"].get("tiers", []):
            rows.append(f"| memory | {row['tier']}: peak RSS / peak private, MB | {fmt(row['peak RSS MB'])} / "
                        f"{fmt(row['peak private MB'])} | with children {fmt(row['peak RSS with children MB'])} |")
    if name == "server":
        for row in r["tables"][next(iter(r["tables"]))]:
            rows.append(f"| server | {r['extra'].get('engine', '')} {row['path']}, tokens/s | {fmt(row['tokens/s'])} | {fmt(row.get('% of direct', ''))} |")
    for t in r["targets"]:
        verdict = "PASS" if t["passed"] else "FAIL"
        op = ">=" if t["higher_is_better"] else "<="
        rows.append(f"| {name} | **target**: {t['name']} | {fmt(t['value'])}{t['unit']} | {op} {fmt(t['threshold'])}{t['unit']}: **{verdict}** |")
    return rows


def main() -> int:
    print("| benchmark | figure | value | anchor / target |")
    print("|---|---|---|---|")
    dates = []
    for name in ORDER:
        r = load(name)
        if r is None:
            continue
        dates.append(f"{name}: {r['machine']['date']}, load average {r['machine']['load_average_at_start'][0]} -> "
                     f"{r['machine']['load_average_at_end'][0]}")
        for line in headline(name, r):
            print(line)
    print()
    for d in dates:
        print(f"- {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
