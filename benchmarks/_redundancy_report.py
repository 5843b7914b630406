"""Judging and reporting :mod:`benchmarks.ram_redundancy` results: checks, markdown, plot.

Everything here reads only the result document (its ``config`` and the raw figures each job
returned), so a report can be rebuilt from a saved JSON file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks._common import MiB, bar_chart, markdown_table, median

LOST = 3
"""The host that is lost and replaced (``benchmarks.ram_redundancy.LOST``)."""


def _check(
    target: str, value: float, bound: float, note: str = "", *, at_least: bool = False
) -> dict[str, Any]:
    ok = value >= bound if at_least else value <= bound
    return {"target": target, "value": value, "bound": bound, "pass": bool(ok), "note": note}


def _overhead(loops: list[dict[str, Any]]) -> float:
    """Median over repeats of (loop with checkpoints / loop without - 1), in percent."""
    base = [x["seconds"] for x in loops if x["arm"] == "base"]
    ckpt = [x["seconds"] for x in loops if x["arm"] == "ckpt"]
    return 100 * median([c / b - 1 for b, c in zip(base, ckpt)])


def _mode_summary(hosts: list[dict[str, Any]], restores: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's figures per host, and the replaced host's restores."""
    held = [h["held"]["held_bytes"] / h["held"]["own_bytes"] for h in hosts]
    sent = [median([c["sent"] for c in h["ckpts"]]) for h in hosts]
    blocked = [s for h in hosts for x in h["loops"] for s in x["save_blocked_s"]]
    replaced = restores[LOST]
    return {
        "held_x_share": held,
        "own_bytes": [h["held"]["own_bytes"] for h in hosts],
        "sent_per_ckpt": sent,
        "received_per_ckpt": [median([c["received"] for c in h["ckpts"]]) for h in hosts],
        "ckpt_s": median([c["seconds"] for h in hosts for c in h["ckpts"]]),
        "save_blocked_ms": 1e3 * median(blocked) if blocked else None,
        "overhead_pct": [_overhead(h["loops"]) for h in hosts],
        "lost_share_s": median([r["seconds"] for r in replaced]),
        "lost_share_fetch_s": median([r["fetch_s"] for r in replaced]),
        "lost_share_bytes": replaced[0]["restored_bytes"],
        "lost_share_received": median([r["link_received"] for r in replaced]),
        "lost_share_by_tier": replaced[0]["bytes_by_tier"],
        "storage_bytes": sum(r["bytes_read_storage"] for h in restores for r in h),
        "checked_shards": sum(r["checked_shards"] for h in restores for r in h),
    }


def summarise(doc: dict[str, Any]) -> None:
    """Add ``summary`` (per mode) and ``checks`` to ``doc``."""
    cfg = doc["config"]
    summary = {
        mode: _mode_summary(hosts, [h["runs"][mode] for h in doc["restore"]])
        for mode, hosts in doc["train"].items()
    }
    doc["summary"] = summary
    rep, par = summary["replicas"], summary["parity"]
    g = cfg["group_size"]
    rebuilt = min(
        r["bytes_by_tier"].get("rebuilt", 0) for r in doc["restore"][LOST]["runs"]["parity"]
    )
    doc["checks"] = [
        _check(
            f"RAM held per host, parity g={g} m=1 (x its own share)",
            max(par["held_x_share"]),
            1.35,
            f"replicas=1: {max(rep['held_x_share']):.2f}x; the data files of the newest step",
        ),
        _check(
            "bytes sent per host per RAM checkpoint, parity / replicas=1",
            max(par["sent_per_ckpt"]) / max(rep["sent_per_ckpt"]),
            1.01,
            "the busiest host's link (eth0 of its namespace), median of the checkpoints; both "
            "send the share once: 1% for framing over g-1 connections instead of 1",
        ),
        _check(
            "rebuild of a lost host's share: seconds / restoring it from a replica",
            par["lost_share_s"] / rep["lost_share_s"],
            2.0,
            f"replaced host's restore: {par['lost_share_s']:.3f} s vs {rep['lost_share_s']:.3f} s",
        ),
        _check(
            f"step overhead, RAM checkpoint with parity every {cfg['interval']} steps (%)",
            max(par["overhead_pct"]),
            3.0,
            f"host-idle step of {cfg['step_s']} s; the slowest host, median of the repeats",
        ),
        _check(
            "the lost host's share rebuilt from parity (bytes)",
            rebuilt,
            1,
            "bytes_by_tier['rebuilt'] of the replaced host, fewest over the repeats",
            at_least=True,
        ),
        _check(
            "restores after the loss read no bytes from storage (both modes)",
            rep["storage_bytes"] + par["storage_bytes"],
            0,
        ),
        _check(
            "every restore bit-exact (shards checked)",
            rep["checked_shards"] + par["checked_shards"],
            1,
            at_least=True,
        ),
    ]


def _gb(x: float) -> str:
    return f"{x:.2f}"


def report(doc: dict[str, Any]) -> str:
    """The markdown page of a results document."""
    cfg, s = doc["config"], doc["summary"]
    modes = list(s)
    rate = f"{cfg['rate_mbit']} Mbit/s" if cfg["rate_mbit"] else "unshaped"
    lines = [
        "# RAM redundancy: parity instead of copies",
        "",
        f"4 simulated hosts x 2 CPU devices, {cfg['share_mib']} MiB of state per host "
        f"({doc['state_bytes'] / MiB:.0f} MiB in all), links {rate}; "
        f"{doc['machine']['cpus']} CPUs; run took {doc['seconds']:.0f} s. Modes: "
        + "; ".join(f"`{m}` = `RamOptions({_kw(doc['modes'][m])})`" for m in modes)
        + ".",
        "",
        "## Checks",
        "",
        markdown_table(
            ["target", "value", "bound", "pass", "note"],
            [
                [
                    c["target"],
                    f"{c['value']:.4g}",
                    c["bound"],
                    "yes" if c["pass"] else "NO",
                    c["note"],
                ]
                for c in doc["checks"]
            ],
        ),
        "",
        "## Per mode",
        "",
        markdown_table(
            ["", *modes],
            [
                ["RAM held per host (x own share), max"]
                + [f"{max(s[m]['held_x_share']):.3f}" for m in modes],
                ["MiB sent per host per RAM checkpoint, max"]
                + [f"{max(s[m]['sent_per_ckpt']) / MiB:.1f}" for m in modes],
                ["MiB received per host per RAM checkpoint, max"]
                + [f"{max(s[m]['received_per_ckpt']) / MiB:.1f}" for m in modes],
                ["RAM checkpoint, save to pushed (s, median)"]
                + [f"{s[m]['ckpt_s']:.3f}" for m in modes],
                ["save() blocked at a checkpoint step (ms, median)"]
                + [_ms(s[m]["save_blocked_ms"]) for m in modes],
                [f"step overhead, checkpoint every {cfg['interval']} steps (%, max host)"]
                + [f"{max(s[m]['overhead_pct']):.2f}" for m in modes],
                ["replaced host's restore (s, median)"]
                + [f"{s[m]['lost_share_s']:.3f}" for m in modes],
                ["replaced host's restore, fetch phase (s)"]
                + [f"{s[m]['lost_share_fetch_s']:.3f}" for m in modes],
                ["replaced host's bytes by source"]
                + [_tiers(s[m]["lost_share_by_tier"]) for m in modes],
                ["replaced host's link received during its restore (x its share)"]
                + [f"{s[m]['lost_share_received'] / s[m]['lost_share_bytes']:.3f}" for m in modes],
            ],
        ),
        "",
        "## Decode beside memcpy and the peer link (GB/s)",
        "",
        markdown_table(
            [
                "XOR (1 thread)",
                "memcpy (1 thread)",
                "raw TCP host0 -> host3",
                "peer wire (get_chunks)",
            ]
            + [f"replaced host's restore, {m}" for m in modes],
            [
                [
                    _gb(doc["decode"]["xor_gbps"]),
                    _gb(doc["decode"]["memcpy_1t_gbps"]),
                    _gb(doc["link"]["raw_gbps"]),
                    _gb(doc["link"]["on_gbps"]),
                    *[_gb(s[m]["lost_share_bytes"] / s[m]["lost_share_s"] / 1e9) for m in modes],
                ]
            ],
        ),
        "",
        "## Per host",
        "",
        markdown_table(
            [
                "host",
                *[f"{m}: {k}" for m in modes for k in ("RAM x share", "MiB sent", "overhead %")],
            ],
            [
                [f"host{i}"]
                + [
                    v
                    for m in modes
                    for v in (
                        f"{s[m]['held_x_share'][i]:.3f}",
                        f"{s[m]['sent_per_ckpt'][i] / MiB:.1f}",
                        f"{s[m]['overhead_pct'][i]:.2f}",
                    )
                ]
                for i in range(len(s[modes[0]]["held_x_share"]))
            ],
        ),
        "",
    ]
    return "\n".join(lines)


def _kw(ram: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in ram.items())


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _tiers(by_tier: dict[str, int]) -> str:
    return ", ".join(f"{k} {v / MiB:.1f} MiB" for k, v in sorted(by_tier.items()))


def plot(doc: dict[str, Any], path: Path) -> None:
    """Five panels: RAM held, bytes sent, the lost share's restore, throughputs, overhead."""
    s = doc["summary"]
    modes = list(s)
    hosts = [f"host{i}" for i in range(len(s[modes[0]]["held_x_share"]))]
    panels = [
        {
            "title": "RAM held per host (x own share)",
            "ylabel": "x share",
            "groups": hosts,
            "series": {m: s[m]["held_x_share"] for m in modes},
            "lines": {"parity target 1.35": 1.35},
        },
        {
            "title": "MiB sent per host per RAM checkpoint",
            "ylabel": "MiB",
            "groups": hosts,
            "series": {m: [x / MiB for x in s[m]["sent_per_ckpt"]] for m in modes},
        },
        {
            "title": f"Step overhead, checkpoint every {doc['config']['interval']} steps",
            "ylabel": "%",
            "groups": hosts,
            "series": {m: s[m]["overhead_pct"] for m in modes},
            "lines": {"target 3%": 3.0},
        },
        {
            "title": "Replaced host's restore (s)",
            "ylabel": "s",
            "groups": ["restore", "fetch phase"],
            "series": {m: [s[m]["lost_share_s"], s[m]["lost_share_fetch_s"]] for m in modes},
        },
        {
            "title": "GB/s: XOR, memcpy, link (TCP, wire), lost share",
            "ylabel": "GB/s",
            "groups": ["XOR", "memcpy", "TCP", "wire", *modes],
            "series": {
                "GB/s": [
                    doc["decode"]["xor_gbps"],
                    doc["decode"]["memcpy_1t_gbps"],
                    doc["link"]["raw_gbps"],
                    doc["link"]["on_gbps"],
                    *[s[m]["lost_share_bytes"] / s[m]["lost_share_s"] / 1e9 for m in modes],
                ]
            },
        },
    ]
    bar_chart(path, panels=panels, title="RAM redundancy: replicas=1 vs parity", ncols=3)
