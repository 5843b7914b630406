"""Judging and reporting :mod:`benchmarks.hosts` results: checks, goals, markdown, plot.

Everything here reads only the result document (``hosts.json``: its ``config`` and the raw
figures of each section), so a report can be rebuilt from a saved JSON file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks._common import MiB, bar_chart, markdown_table, median

GIB = float(1 << 30)
GMAC = "GMAC (AES-256-GCM, data as AAD)"
DEFAULTS = {"save": "4", "restore": "8"}
"""``SaveOptions.upload_concurrency`` and ``RestoreOptions.read_concurrency`` defaults."""


def _check(
    target: str, value: float, bound: float, note: str = "", *, at_least: bool = True
) -> dict[str, Any]:
    ok = value >= bound if at_least else value <= bound
    return {"target": target, "value": value, "bound": bound, "pass": bool(ok), "note": note}


def _link(rate: str) -> str:
    return f"{int(rate) / 1000:g} Gbit/s" if int(rate) else "unshaped"


def _seconds(doc: dict[str, Any], kind: str, delay: str) -> dict[str, float]:
    """Median seconds of the remote section's ``kind`` (save, restore) per concurrency."""
    runs = doc["remote"]["delays"][delay][kind]
    return {c: median([r["seconds"] for r in rs]) for c, rs in runs.items()}


def _tput(doc: dict[str, Any], kind: str, delay: str) -> dict[str, float]:
    """GB/s of the remote section's ``kind`` (save, restore) per concurrency at ``delay``."""
    total = doc["remote"]["total_bytes"]
    return {c: total / s / 1e9 for c, s in _seconds(doc, kind, delay).items()}


def _lost_host_summary(r: dict[str, Any]) -> dict[str, Any]:
    """The replaced host's (median) restore beside the link measurements of one link setting."""
    rep, link, nbytes = r["restore"][3]["ram"], r["link"], r["peer_bytes"]
    raw = link[link["raw"]]["gbps"]
    fetch = nbytes / rep["fetch_s"] / 1e9
    return {
        "seconds": rep["seconds"],
        "runs_s": [run[3]["ram"]["seconds"] for run in r["runs"]],
        "select_s": rep["select_s"],
        "fetch_s": rep["fetch_s"],
        "device_put_s": rep["device_put_s"],
        "other_s": rep["seconds"] - rep["select_s"] - rep["fetch_s"] - rep["device_put_s"],
        "startup_s": rep["startup_s"],
        "first_gcs_s": r["first_gcs_request"]["first_s"],
        "e2e_gbps": nbytes / rep["seconds"] / 1e9,
        "fetch_gbps": fetch,
        "raw_gbps": raw,
        "raw_streams": link["raw"],
        "on_gbps": link["on"]["gbps"],
        "off_gbps": link["off"]["gbps"],
        "fresh_gbps": link["fresh"]["gbps"],
        "rawfresh_gbps": link["rawfresh"]["gbps"],
        "e2e_vs_rawfresh": nbytes / rep["seconds"] / 1e9 / link["rawfresh"]["gbps"],
        "e2e_fraction": nbytes / rep["seconds"] / 1e9 / raw,
        "fetch_fraction": fetch / raw,
        "wire_fraction": link["on"]["gbps"] / raw,
        "fresh_fraction": link["fresh"]["gbps"] / raw,
        "mac_cost": 1 - link["on"]["gbps"] / link["off"]["gbps"],
    }


def summarise(doc: dict[str, Any]) -> None:
    """Add derived figures (``doc["lost_host"]["summary"]``), ``checks`` (targets; a failed
    one fails the run) and ``goals`` (reported only) to ``doc``."""
    cfg = doc["config"]
    checks, goals = [], []
    rows = {rate: _lost_host_summary(r) for rate, r in doc["lost_host"]["rates"].items()}
    doc["lost_host"]["summary"] = rows
    for rate, s in rows.items():
        if not int(rate):
            continue  # unshaped: CPU-bound TCP on this machine, reported only
        note = (
            f"{s['e2e_gbps']:.3f} vs raw TCP {s['raw_gbps']:.3f} GB/s ({s['raw_streams']}); "
            f"wire get_chunks {s['wire_fraction']:.0%} "
            f"(into new memory {s['fresh_fraction']:.0%}), "
            f"fetch phase {s['fetch_fraction']:.0%}; of raw TCP into new memory "
            f"{s['e2e_vs_rawfresh']:.0%}"
        )
        label = f"{_link(rate)} link"
        checks.append(
            _check(f"peer restore >= 80% of raw TCP, {label}", s["e2e_fraction"], 0.8, note)
        )
        goals.append(
            _check(f"peer restore >= 90% of raw TCP, {label}", s["e2e_fraction"], 0.9, note)
        )
        note = f"get_chunks {s['on_gbps']:.3f} GB/s on vs {s['off_gbps']:.3f} off"
        goals.append(
            _check(
                f"frame MACs cost <= 10% of peer throughput, {label}",
                s["mac_cost"],
                0.1,
                note,
                at_least=False,
            )
        )
    shaped = [str(r) for r in cfg["rates"] if r]
    if len(shaped) >= 2:
        lo, hi = rows[shaped[0]], rows[shaped[-1]]
        want = int(shaped[-1]) / int(shaped[0])
        goals.append(
            _check(
                f"restore throughput follows the link rate "
                f"({_link(shaped[0])} -> {_link(shaped[-1])}: x{want:g})",
                hi["e2e_gbps"] / lo["e2e_gbps"],
                0.9 * want,
                f"fraction of raw TCP {lo['e2e_fraction']:.0%} -> {hi['e2e_fraction']:.0%}",
            )
        )
    read = [
        h["ram"]["bytes_read_storage"]
        for r in doc["lost_host"]["rates"].values()
        for run in r["runs"]
        for h in run
    ] + [h["ram"]["bytes_read_storage"] for h in doc["resize"]["hosts"]]
    checks.append(
        _check("RAM + peer restores read no bytes from GCS", sum(read), 0, at_least=False)
    )
    ns = [str(n) for n in cfg["scale_hosts"]]
    t = {n: doc["scaling"][n]["restore"][-1]["ram"]["seconds"] for n in ns}
    goals.append(
        _check(
            f"replaced host's restore flat from {ns[0]} to {ns[-1]} hosts (time ratio)",
            t[ns[-1]] / t[ns[0]],
            1.25,
            ", ".join(f"{n}: {t[n]:.2f} s" for n in ns),
            at_least=False,
        )
    )
    far = str(max(cfg["delays_ms"], default=0))
    for kind, default in DEFAULTS.items():
        tput = _tput(doc, kind, far)
        best = max(tput.values())
        note = ", ".join(f"{c}: {v:.3f} GB/s" for c, v in tput.items())
        checks.append(
            _check(
                f"GCS {kind} at +{2 * int(far)} ms RTT: default concurrency "
                f"({default}) >= 70% of the best",
                tput[default] / best,
                0.7,
                note,
            )
        )
    note = f"and {doc['checked_wire_bytes'] / MiB:.0f} MiB received by get_chunks"
    checks.append(
        _check("every restore bit-exact (shards checked)", doc["checked_shards"], 1, note)
    )
    doc["checks"], doc["goals"] = checks, goals


def _table(heads: list[str], rows: list[list[Any]]) -> str:
    return markdown_table(heads, rows)


def report(doc: dict[str, Any]) -> str:
    """The markdown page: every section's table (what each figure is: docs/benchmarks.md)."""
    cfg, m, lh = doc["config"], doc["machine"], doc["lost_host"]
    out = [
        f"# fastckpt across simulated hosts ({'quick' if cfg['quick'] else 'full'} run)",
        (
            f"`{doc['command']}`, {doc['when']}, git `{doc['git']}`, {m['cpus']} CPUs, "
            f"{m['mem_gib']:.0f} GiB; load average {m['load_start'][0]:.2f} at the start, "
            f"{m['load_end'][0]:.2f} at the end; {doc['seconds']:.0f} s in all. Lost-host "
            f"share {cfg['share_mib']} MiB per host (state {lh['state_bytes'] / MiB:.0f} MiB "
            f"on 4 x 2 devices), scaling share {cfg['scale_share_mib']} MiB, GCS state "
            f"{cfg['remote_mib']} MiB; link figures: median of {cfg['repeats']} interleaved runs."
        ),
        "## Checks",
    ]
    for name, ok_word, items in (("check", "PASS", doc["checks"]), ("goal", "met", doc["goals"])):
        if name == "goal":
            out.append("## Goals (reported, not enforced)")
        fail = "FAIL" if name == "check" else "not met"
        rows = [
            [
                c["target"],
                f"{c['value']:.3g}",
                f"{c['bound']:g}",
                ok_word if c["pass"] else fail,
                c["note"],
            ]
            for c in items
        ]
        out.append(_table([name, "value", "bound", "result", "note"], rows))
    out.append("## Lost host: the link between the replaced host and its peer (GB/s)")
    link_heads = {
        "raw1": "raw TCP 1 stream",
        "raw4": "raw TCP 4",
        "rawfresh": "raw TCP into new memory",
        "off": "get_chunks MAC off",
        "on": "MAC on",
        "on2": "MAC on, 2 connections",
        "fresh": "MAC on, into new memory",
    }
    rows = [
        [_link(rate), f"{r['peer_bytes'] / MiB:.0f} from {r['source']}"]
        + [f"{r['link'][k]['gbps']:.3f}" for k in link_heads]
        for rate, r in lh["rates"].items()
    ]
    out.append(_table(["link", "MiB", *link_heads.values()], rows))
    out.append("## Lost host: the replaced host's restore (median of its runs)")
    rows = [
        [
            _link(rate),
            f"{s['seconds']:.2f} ({', '.join(f'{x:.2f}' for x in s['runs_s'])})",
            f"{s['e2e_gbps']:.3f}",
            f"{s['e2e_fraction']:.0%}",
            f"{s['e2e_vs_rawfresh']:.0%}",
            f"{s['select_s']:.2f}",
            f"{s['first_gcs_s']:.2f}",
            f"{s['fetch_s']:.2f} ({s['fetch_fraction']:.0%})",
            f"{s['device_put_s'] + s['other_s']:.3f}",
            f"{s['startup_s']:.2f}",
        ]
        for rate, s in lh["summary"].items()
    ]
    heads = [
        "link",
        "restore s (runs)",
        "GB/s",
        "of raw TCP",
        "of raw TCP into new memory",
        "select s",
        "first GCS request of a new process s",
        "fetch s (of raw TCP)",
        "placing s",
        "manager start-up s",
    ]
    out.append(_table(heads, rows))
    out.append("## Wire protection: CPU seconds per GiB moved (client + server)")
    rows = [
        [_link(rate)]
        + [
            f"{lh['rates'][rate]['link'][k]['client_cpu_s_per_gib']:.3f} + "
            f"{lh['rates'][rate]['link'][k]['server_cpu_s_per_gib']:.3f}"
            for k in ("raw1", "off", "on")
        ]
        + [f"{s['mac_cost']:+.0%}"]
        for rate, s in lh["summary"].items()
    ]
    out.append(
        _table(["link", "raw TCP 1 stream", "MAC off", "MAC on", "throughput lost to MACs"], rows)
    )
    one = doc["macs"]["gbps_one_thread"]
    out.append(
        f"One thread alone: GMAC {one[GMAC]:.1f} GB/s = {GIB / one[GMAC] / 1e9:.3f} CPU s "
        f"per GiB per side; crc32c {one['crc32c']:.1f} GB/s = "
        f"{GIB / one['crc32c'] / 1e9:.3f} CPU s per GiB."
    )
    out.append(f"## Resize 4 -> 3 hosts ({_link(str(doc['resize']['rate']))}): RAM + peers vs GCS")
    rows = []
    for h in doc["resize"]["hosts"]:
        ram, gcs = h["ram"], h["storage"]
        tiers = ", ".join(f"{k} {v / MiB:.0f}" for k, v in sorted(ram["bytes_by_tier"].items()))
        rows.append(
            [
                h["member"],
                f"{ram['seconds']:.2f}",
                f"{ram['select_s']:.2f}",
                tiers,
                f"{gcs['seconds']:.2f}",
                f"{gcs['bytes_read_storage'] / MiB:.0f}",
            ]
        )
    out.append(
        _table(["host", "RAM + peers s", "select s", "MiB by tier", "GCS s", "GCS MiB read"], rows)
    )
    sc = doc["scaling"]
    out.append(
        f"## Scaling: lose one host of N ({_link(str(sc['rate']))}, 1 device and "
        f"{sc['share_bytes'] / MiB:.0f} MiB per host)"
    )
    rows = []
    for n in map(str, cfg["scale_hosts"]):
        rs = [h["ram"] for h in sc[n]["restore"]]
        rep = rs[-1]
        rows.append(
            [
                n,
                *(f"{rep[k]:.2f}" for k in ("seconds", "select_s", "fetch_s", "startup_s")),
                f"{max(r['select_s'] for r in rs):.2f}",
                f"{max(r['startup_s'] for r in rs):.2f}",
                f"{max(s['startup_s'] for s in sc[n]['save']):.2f}",
                f"{sum(r['cpu_s'] for r in rs):.2f}",
            ]
        )
    out.append(
        _table(
            [
                "hosts",
                "restore s",
                "select s",
                "fetch s",
                "start-up s",
                "max select s",
                "max start-up s",
                "save job: max start-up s",
                "restore CPU s, all hosts",
            ],
            rows,
        )
    )
    rem = doc["remote"]
    out.append(
        f"## GCS at a distance: {rem['total_bytes'] / MiB:.0f} MiB, one process, "
        f"{rem['object_bytes'] / MiB:.0f} MiB objects (GB/s; median seconds of "
        f"{cfg['repeats']})"
    )
    rows = []
    for d in rem["delays"]:
        for kind in DEFAULTS:
            secs = _seconds(doc, kind, d)
            rows.append(
                [f"+{2 * int(d)} ms" if int(d) else "direct", kind]
                + [f"{rem['total_bytes'] / t / 1e9:.3f}; {t:.2f}" for t in secs.values()]
            )
    heads = [
        f"{u} / {r} in flight"
        + (" (defaults)" if (str(u), str(r)) == tuple(DEFAULTS.values()) else "")
        for u, r in zip(cfg["uploads"], cfg["reads"], strict=True)
    ]
    out.append(_table(["RTT added", "", *heads], rows))
    return "\n\n".join(out) + "\n"


def plot(doc: dict[str, Any], path: Path) -> None:
    """Seven panels: each section's headline figures (``benchmarks._common.bar_chart``)."""
    cfg, lh = doc["config"], doc["lost_host"]
    links, s = [_link(r) for r in lh["summary"]], list(lh["summary"].values())
    rates = list(lh["rates"].values())

    def cpu(k: str) -> list[float]:
        return [
            r["link"][k]["client_cpu_s_per_gib"] + r["link"][k]["server_cpu_s_per_gib"]
            for r in rates
        ]

    def rep(n: int, k: str) -> float:
        return float(doc["scaling"][str(n)]["restore"][-1]["ram"][k])

    resize = doc["resize"]["hosts"]
    one = doc["macs"]["gbps_one_thread"]
    panels = [
        {
            "title": "Lost host: GB/s over the same link",
            "ylabel": "GB/s",
            "groups": links,
            "series": {
                "raw TCP": [x["raw_gbps"] for x in s],
                "wire MAC off": [x["off_gbps"] for x in s],
                "wire MAC on": [x["on_gbps"] for x in s],
                "peer restore": [x["e2e_gbps"] for x in s],
            },
        },
        {
            "title": "Fraction of raw TCP",
            "ylabel": "fraction",
            "groups": links,
            "lines": {"target 0.8": 0.8},
            "series": {
                "peer restore": [x["e2e_fraction"] for x in s],
                "fetch phase": [x["fetch_fraction"] for x in s],
                "wire MAC on": [x["wire_fraction"] for x in s],
                "wire, new memory": [x["fresh_fraction"] for x in s],
            },
        },
        {
            "title": "CPU s per GiB, both ends",
            "ylabel": "CPU s / GiB",
            "groups": links,
            "series": {"raw TCP": cpu("raw1"), "MAC off": cpu("off"), "MAC on": cpu("on")},
            "lines": {"GMAC alone, both ends": 2 * GIB / one[GMAC] / 1e9},
        },
        {
            "title": "Resize 4 -> 3: restore s per host",
            "ylabel": "s",
            "groups": [h["member"] for h in resize],
            "series": {
                "RAM + peers": [h["ram"]["seconds"] for h in resize],
                "GCS": [h["storage"]["seconds"] for h in resize],
            },
        },
        {
            "title": "Scaling: the replaced host (s)",
            "ylabel": "s",
            "groups": [f"{n} hosts" for n in cfg["scale_hosts"]],
            "series": {
                k: [rep(n, f) for n in cfg["scale_hosts"]]
                for k, f in (
                    ("restore", "seconds"),
                    ("select", "select_s"),
                    ("fetch", "fetch_s"),
                    ("start-up", "startup_s"),
                )
            },
        },
    ]
    for kind in DEFAULTS:
        by_delay = {d: _tput(doc, kind, d) for d in doc["remote"]["delays"]}
        conc = list(next(iter(by_delay.values())))
        panels.append(
            {
                "title": f"GCS {kind} vs requests in flight",
                "ylabel": "GB/s",
                "groups": [f"+{2 * int(d)} ms RTT" for d in by_delay],
                "series": {c: [t[c] for t in by_delay.values()] for c in conc},
            }
        )
    bar_chart(path, panels=panels, title="fastckpt across simulated hosts", ncols=4)
