"""Turn one run's results into JSON, a markdown table, target verdicts and PNG charts.

The JSON is the record (everything measured, including CPU of other processes); the markdown
and the charts are views of it, regenerated from it alone (``render(results)``), so a
table in the docs can always be traced back to a JSON file in ``benchmarks/results/``.

Target verdicts follow issue 7 and are computed only from brokers measured in the same
run: a ratio against a broker that failed or was not installed is "not evaluated", never
a guess.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: (scenario, key, label, unit, higher_is_better)
METRICS: list[tuple[str, str, str, str, bool]] = [
    ("fanin_qos0", "deliveries_per_s", "fan-in QoS 0 (4 pub -> 1 sub)", "msg/s", True),
    ("fanin_qos1", "deliveries_per_s", "fan-in QoS 1 (4 pub -> 1 sub)", "msg/s", True),
    ("fanout", "deliveries_per_s", "fan-out (1 pub -> 100 sub)", "deliveries/s", True),
    ("wildcard", "deliveries_per_s", "wildcard routing (1,000 filters)", "msg/s", True),
    ("latency", "p50_ms", "latency p50 @ 200 msg/s", "ms", False),
    ("latency", "p99_ms", "latency p99 @ 200 msg/s", "ms", False),
    ("idle", "rss_per_conn_kb", "RSS per idle connection", "KB", False),
    ("idle", "connects_per_s", "connects/s", "conn/s", True),
    ("retained", "receive_all_s", "retained: receive all (wildcard sub)", "s", False),
    ("retained", "publish_s", "retained: store all (QoS 1)", "s", False),
    ("cluster", "internode_per_publish", "cluster: inter-node msgs per publish", "msgs", False),
    ("cluster", "cpu_ratio_vs_single", "cluster: CPU/delivery vs single node", "x", False),
    ("cluster", "internode_per_publish_spread",
     "cluster, 1,000 topics: inter-node msgs per publish", "msgs", False),
    ("cluster", "cpu_ratio_vs_single_spread",
     "cluster, 1,000 topics: CPU/delivery vs single node", "x", False),
]

NOISY_OTHER_CORES = 0.25


def _scen(results: dict[str, Any], broker: str, scenario: str) -> dict[str, Any] | None:
    b = results["brokers"].get(broker)
    if not b or b.get("unavailable"):
        return None
    return b["scenarios"].get(scenario)


def _value(results: dict[str, Any], broker: str, scenario: str, key: str) -> float | None:
    s = _scen(results, broker, scenario)
    if not s or s.get("status") != "ok":
        return None
    v = s.get(key)
    return float(v) if isinstance(v, int | float) else None


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets for mqttring, each met / not met / not evaluated (with why)."""
    out: list[dict[str, Any]] = []
    me = "mqttring"

    def add(name: str, met: bool | None, value: Any, detail: str) -> None:
        out.append({"target": name, "met": met, "value": value, "detail": detail})

    def ratio(scenario: str, other: str, need: float, name: str, extra_ok: bool = True) -> None:
        a = _value(results, me, scenario, "deliveries_per_s")
        b = _value(results, other, scenario, "deliveries_per_s")
        theirs = _scen(results, other, scenario) or {}
        lossy = ""
        if b is None and theirs.get("lost") and isinstance(theirs.get("deliveries_per_s"),
                                                             int | float):
            # The reference lost acknowledged messages (it failed for that alone): its rate
            # is still what we are compared with, with the loss said next to it.
            b = float(theirs["deliveries_per_s"])
            lossy = f" ({other} lost {theirs['lost']:,} acknowledged messages)"
        s = _scen(results, me, scenario)
        if s and s.get("status") == "failed":
            add(name, False, None, f"mqttring failed: {s.get('error')}")
        elif a is None or b is None:
            add(name, None, None, f"not evaluated: {me if a is None else other} not measured")
        else:
            r = a / b
            add(
                name,
                r >= need and extra_ok,
                round(r, 2),
                f"{a:,.0f} vs {other} {b:,.0f} msg/s{lossy} = {r:.2f}x (need >= {need}x)",
            )

    ratio("fanin_qos0", "mosquitto", 0.5, "fan-in QoS 0 >= 0.5x mosquitto")
    ratio("fanin_qos0", "amqtt", 5.0, "fan-in QoS 0 >= 5x amqtt")
    q1 = _scen(results, me, "fanin_qos1") or {}
    ratio(
        "fanin_qos1",
        "mosquitto",
        0.5,
        "fan-in QoS 1 >= 0.5x mosquitto, zero loss",
        extra_ok=q1.get("lost", 1) == 0,
    )
    ratio("fanout", "mosquitto", 0.5, "fan-out >= 0.5x mosquitto")
    lat = _scen(results, me, "latency")
    p99 = _value(results, me, "latency", "p99_ms")
    if p99 is None:
        add(
            "latency p99 <= 1 ms @ 200 msg/s",
            None if not lat else False,
            None,
            (lat or {}).get("error", "not evaluated: mqttring not measured"),
        )
    else:
        add("latency p99 <= 1 ms @ 200 msg/s", p99 <= 1.0, p99, f"p99 {p99} ms")
    idle = _scen(results, me, "idle")
    kb = _value(results, me, "idle", "rss_per_conn_kb")
    n = (idle or {}).get("connections")
    if kb is None:
        add(
            "<= 8 KB RSS per idle connection @ 10,000",
            None if not idle else False,
            None,
            (idle or {}).get("error", "not evaluated: mqttring not measured"),
        )
    else:
        add(
            "<= 8 KB RSS per idle connection @ 10,000",
            kb <= 8.0,
            kb,
            f"{kb} KB/conn at {n:,} connections"
            + ("" if n == 10_000 else " (quick mode: indicative only, target is at 10,000)"),
        )
    cl = _scen(results, me, "cluster") or {}
    for key, name in (
        ("internode_per_publish", "cluster inter-node msgs/publish <= 1 + N_sub"),
        ("cpu_ratio_vs_single", "cluster CPU/delivery <= 2x single node"),
        ("internode_per_publish_spread",
         "cluster inter-node msgs/publish <= 1 + N_sub, 1,000 topics"),
        ("cpu_ratio_vs_single_spread", "cluster CPU/delivery <= 2x single node, 1,000 topics"),
    ):
        if cl.get("status") == "ok":
            limit = 1 + cl.get("nodes_with_subscribers", 0) if key.startswith("inter") else 2.0
            add(name, cl[key] <= limit, cl[key], f"{cl[key]} (limit {limit})")
        else:
            add(name, None, None, cl.get("reason") or cl.get("error") or "not measured")
    return out


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and v >= 100:
        return f"{v:,.0f}"
    if isinstance(v, float):
        return f"{v:.3g}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def _cell(results: dict[str, Any], broker: str, scenario: str, key: str) -> str:
    b = results["brokers"].get(broker, {})
    if b.get("unavailable"):
        return "not run"
    s = b.get("scenarios", {}).get(scenario)
    if s is None:
        return "-"
    if s.get("status") == "not available":
        return "n/a"
    if s.get("status") != "ok":
        return "**FAILED**"
    return _fmt(s.get(key))


def markdown(results: dict[str, Any]) -> str:
    brokers = list(results["brokers"])
    m = results["machine"]
    lines = [
        f"# Benchmark run {results['stamp']} ({results['mode']} mode)",
        "",
        f"{m['cores_logical']} logical cores ({m['cpu_model']}), {m['memory_gb']} GB, "
        f"Linux {m['kernel']}, Python {m['python']}; commit {m['commit']}.",
        "Versions: "
        + ", ".join(f"{n} {b.get('version', '?')}" for n, b in results["brokers"].items())
        + ".",
        "",
        "| scenario | unit | "
        + " | ".join(brokers)
        + (" | mqttring / mosquitto |" if {"mqttring", "mosquitto"} <= set(brokers) else " |"),
        "|---|---|"
        + "---|" * len(brokers)
        + ("---|" if {"mqttring", "mosquitto"} <= set(brokers) else ""),
    ]
    for scenario, key, label, unit, _ in METRICS:
        row = (
            f"| {label} | {unit} | "
            + " | ".join(_cell(results, b, scenario, key) for b in brokers)
            + " |"
        )
        if {"mqttring", "mosquitto"} <= set(brokers):
            a = _value(results, "mqttring", scenario, key)
            c = _value(results, "mosquitto", scenario, key)
            row += f" {a / c:.2f}x |" if a is not None and c else " - |"
        lines.append(row)
    ceiling = results.get("generator_ceiling") or {}
    if ceiling.get("status") == "ok":
        lines += [
            "",
            f"Generator ceiling (same workers against a discarding/flooding sink): "
            f"publish {_fmt(ceiling['publish_msgs_per_s'])} msg/s, "
            f"read {_fmt(ceiling['read_msgs_per_s'])} msg/s.",
        ]
    lines += ["", "## Targets (issue 7)", "", "| target | verdict | detail |", "|---|---|---|"]
    for t in results.get("targets", []):
        verdict = {True: "met", False: "**not met**", None: "not evaluated"}[t["met"]]
        lines.append(f"| {t['target']} | {verdict} | {t['detail']} |")
    lines += ["", "## Failures, loss and noise", ""]
    notes = 0
    for name, b in results["brokers"].items():
        if b.get("unavailable"):
            lines.append(f"- {name}: not run: {b['unavailable']}")
            notes += 1
            continue
        for scen, s in b["scenarios"].items():
            if s.get("status") == "failed":
                lines.append(f"- {name} / {scen}: FAILED: {s.get('error')}")
                notes += 1
            elif s.get("status") == "not available":
                lines.append(f"- {name} / {scen}: not available: {s.get('reason')}")
                notes += 1
            if s.get("note"):
                lines.append(f"- {name} / {scen}: {s['note']}")
                notes += 1
            if s.get("lost"):
                lines.append(
                    f"- {name} / {scen}: {s['lost']:,} messages lost (QoS {s.get('qos', 0)})"
                )
                notes += 1
            cpu = s.get("cpu") or {}
            if cpu.get("elapsed_s"):
                other = cpu["other_s"] / cpu["elapsed_s"]
                if other > NOISY_OTHER_CORES:
                    lines.append(
                        f"- {name} / {scen}: noisy: other processes used "
                        f"{other:.2f} cores during the measurement"
                    )
                    notes += 1
    if not notes:
        lines.append("- none")
    return "\n".join(lines) + "\n"


def charts(results: dict[str, Any], path: Path) -> Path | None:
    """One PNG: throughput, latency, memory, retained, side by side per broker."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    brokers = [b for b, v in results["brokers"].items() if not v.get("unavailable")]
    if not brokers:
        return None
    panels = [
        (
            "throughput (msg/s; fan-out: deliveries/s)",
            [
                ("fanin_qos0", "deliveries_per_s", "fan-in q0"),
                ("fanin_qos1", "deliveries_per_s", "fan-in q1"),
                ("fanout", "deliveries_per_s", "fan-out"),
                ("wildcard", "deliveries_per_s", "wildcard"),
            ],
        ),
        ("latency @ 200 msg/s (ms)", [("latency", "p50_ms", "p50"), ("latency", "p99_ms", "p99")]),
        ("RSS per idle connection (KB)", [("idle", "rss_per_conn_kb", "KB/conn")]),
        ("retained: time to receive all (s)", [("retained", "receive_all_s", "receive all")]),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    width = 0.8 / len(brokers)
    for ax, (title, series) in zip(axes.flat, panels, strict=True):
        for i, b in enumerate(brokers):
            vals = [_value(results, b, s, k) or 0.0 for s, k, _ in series]
            xs = [j + i * width for j in range(len(series))]
            ax.bar(xs, vals, width, label=b)
        ax.set_xticks([j + width * (len(brokers) - 1) / 2 for j in range(len(series))])
        ax.set_xticklabels([lbl for _, _, lbl in series])
        ax.set_title(title)
        ax.legend()
    fig.suptitle(
        f"mqttring benchmarks {results['stamp']} ({results['mode']}); "
        "failed scenarios are drawn as 0"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write(results: dict[str, Any], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    results["targets"] = targets(results)
    stamp = results["stamp"]
    paths = [out_dir / f"{stamp}.json", out_dir / f"{stamp}.md"]
    paths[0].write_text(json.dumps(results, indent=1, default=str) + "\n")
    paths[1].write_text(markdown(results))
    png = charts(results, out_dir / f"{stamp}.png")
    if png:
        paths.append(png)
    return paths
