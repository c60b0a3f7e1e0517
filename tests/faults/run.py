"""``python -m tests.faults.run --nodes 3|5|3,5 --scenario NAME|all --out DIR [--runs N]``

Outer process (root, host namespace): removes leftovers of crashed runs, builds the
namespaces, re-executes itself inside the client namespace with ``--inner``, and always
tears the namespaces down (``finally``, ``atexit`` and SIGINT/SIGTERM/SIGHUP handlers).
Inner process: runs the scenarios (``scenario.run_scenario``) and writes ``report.json``.
The outer one then writes the markdown summary and exits non-zero if any check failed
(2 if the harness could not run at all).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from . import netns
from .scenario import SCENARIOS, TOTAL_RATE, Timing, run_scenario

OVERALL_BOUND = 30 * 60  # seconds for the inner process, whatever happens


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.faults.run", description=__doc__)
    parser.add_argument("--nodes", default="3", help="3, 5 or a list such as 3,5")
    parser.add_argument("--scenario", default="all",
                        help=f"one of {', '.join(SCENARIOS)}, a comma list, or all")
    parser.add_argument("--out", type=Path, default=Path("tests/faults/results/latest"))
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--short", action="store_true", help="shorter fault windows")
    parser.add_argument("--grace", type=float, default=5.0,
                        help="failure_grace of the nodes (default: the product default 5 s)")
    parser.add_argument("--rate", type=float, default=TOTAL_RATE,
                        help="data messages per second over all publishers (default %(default)s)")
    parser.add_argument("--md", type=Path, help="also write the markdown summary here")
    parser.add_argument("--json", type=Path, help="also copy report.json here")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--topology", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def plan(args: argparse.Namespace) -> list[tuple[int, str, int]]:
    sizes = [int(n) for n in str(args.nodes).split(",")]
    for n in sizes:
        if n not in (3, 5):
            raise SystemExit("--nodes: 3 or 5")
    names = list(SCENARIOS) if args.scenario == "all" else args.scenario.split(",")
    for name in names:
        if name not in SCENARIOS:
            raise SystemExit(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
    return [(n, s, r) for n in sizes for s in names for r in range(1, args.runs + 1)]


def inner(args: argparse.Namespace) -> int:
    topology = netns.Topology.from_dict(json.loads(args.topology))
    timing = Timing.short() if args.short else Timing()
    runs = []
    args.out.mkdir(parents=True, exist_ok=True)
    for size, scenario, run_no in plan(args):
        nodes = topology.nodes[:size]
        where = args.out / f"{size}n-{scenario}-{run_no}"
        print(f"[faults] {size} nodes, {scenario}, run {run_no} ...", flush=True)
        topology.heal()  # nothing of a previous run's faults may remain
        report = run_scenario(topology, nodes, scenario, where, timing, grace=args.grace,
                              spare=topology.nodes[size], rate=args.rate)
        report["run"] = run_no
        report["dir"] = str(where)
        runs.append(report)
        (where / "report.json").write_text(json.dumps(report, indent=1, default=str))
        print(f"[faults]   {'PASS' if report['ok'] else 'FAIL'} in {report['duration_s']} s"
              + "".join(f"\n[faults]     - {f}" for f in report["failures"]), flush=True)
    summary = {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "timing": timing.__dict__, "failure_grace": args.grace, "rate": args.rate,
               "runs": runs,
               "ok": all(r["ok"] for r in runs)}
    (args.out / "report.json").write_text(json.dumps(summary, indent=1, default=str))
    return 0 if summary["ok"] else 1


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def markdown(summary: dict[str, Any]) -> str:
    lines = [
        "# Fault suite report",
        "",
        f"Generated {summary['created']} by `python -m tests.faults.run` "
        f"(fault {summary['timing']['fault']:.0f} s, warm-up {summary['timing']['warmup']:.0f}"
        f" s, after-heal {summary['timing']['post']:.0f} s, failure_grace "
        f"{summary['failure_grace']} s, {summary.get('rate', 120):.0f} msg/s). "
        "See `docs/faults.md` for what each column means.",
        "",
        "| nodes | scenario | result | acked | lost (pers.) | lost (clean) | dups (QoS 2) "
        "| reorders "
        "| retained regr. | 2 live sessions | convergence s | will delay s | spurious wills "
        "| max stall s | Raft elections | crashes |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
        "| --- | --- |",
    ]
    for r in summary["runs"]:
        d = r["delivery"]
        wills = [w["delay_s"] for w in r["wills"] if w.get("expected")]
        will_txt = ", ".join(_fmt(w) if w is not None else "never" for w in wills) or "n/a"
        crashes = len(r["crashes"]["unexpected_exits"]) + sum(r["crashes"]["tracebacks"]
                                                              .values())
        lines.append(
            f"| {r['nodes']} | {r['scenario']} | {'PASS' if r['ok'] else '**FAIL**'} "
            f"| {d.get('acked', 0)} | {d['lost_persistent']} | {d['lost_clean']} "
            f"| {d['duplicates']} ({d.get('qos2_duplicates', 0)}) | {d['reorders']} "
            f"| {len(r['retained']['regressions'])} "
            f"| {r['dual_sessions']['violations']} | {_fmt(r['convergence']['seconds'])} "
            f"| {will_txt} | {sum(bool(w.get('spurious')) for w in r['wills'])} "
            f"| {_fmt(r.get('stall', {}).get('max_gap_s'))} "
            f"| {r.get('raft', {}).get('elections', '-')} | {crashes} |")
    lines += ["", "## Failures", ""]
    for r in summary["runs"]:
        if r["failures"]:
            lines.append(f"* {r['nodes']} nodes, {r['scenario']} (run {r['run']}):")
            lines += [f"  * {f}" for f in r["failures"]]
    if all(r["ok"] for r in summary["runs"]):
        lines.append("None.")
    lines += ["", "## Details", ""]
    for r in summary["runs"]:
        lines.append(f"### {r['nodes']} nodes, {r['scenario']} (run {r['run']})")
        lines.append("")
        lines += [f"* {line}" for line in details(r)]
        lines.append("")
    return "\n".join(lines)


def details(r: dict[str, Any]) -> list[str]:
    """The figures behind one table row, in words."""
    out = [f"leader {r.get('leader')}, victims {r.get('victims')}, events (s from start) "
           f"{r.get('events_s')}, restart ready {r.get('restart_ready_s', '-')} s, "
           f"settled {r.get('settled_s_after_stop', '-')} s after the publishers stopped"]
    d = r["delivery"]
    if "per_subscriber" in d:
        subs = ", ".join(f"{k} {v['lost']}/{v['owed']}"
                         + (f" (session lost {v['session_lost']}x)" if v["session_lost"] else "")
                         for k, v in d["per_subscriber"].items())
        out.append(f"lost/owed per subscriber: {subs}; acknowledged but delivered to nobody: "
                   f"{d.get('acked_never_delivered')}")
    t = r.get("throughput")
    if t:
        out.append(f"publishes sent {t['sent']}, acknowledged {t['acked']} ({t['per_s']}/s; "
                   f"{t.get('per_s_before_fault')}/s before the fault)")
    s = r.get("stall")
    if s:
        out.append(f"longest PUBACK gap {s['max_gap_s']} s overall, per publisher "
                   f"{s['per_publisher_max_gap_s']}; abandoned connections "
                   f"{s['abandoned_connections']}")
    raft = r.get("raft")
    if raft:
        out.append(f"Raft terms before the fault {raft['terms_before_fault']}, after "
                   f"{raft['terms_after']}: {raft['elections']} elections")
    c = r["convergence"]
    out.append(f"convergence {c['seconds']} s after the heal (rounds {c.get('rounds')})"
               + (f", last missing {c['last_missing']}" if c.get("last_missing") else ""))
    for w in r["wills"]:
        spurious = (f" (SPURIOUS, {w.get('arrived_s_after_fault')} s after the fault: "
                    "client still connected)") if w["spurious"] else ""
        out.append(f"will {w['client']} on {w['node']}: connection broke "
                   f"{w['broke_s_after_fault']} s after the fault, will after "
                   f"{w['delay_s']} s{spurious}")
    for p in r["dual_sessions"].get("probes", []):
        out.append(f"dual {p['client_id']}: first on {p['first_node']}, second on "
                   f"{p['second_node']} ({p['refusals']} refusals), both live "
                   f"{p.get('overlap_s')} s ({p.get('overlap_after_heal')} s after the heal)")
    for reg in r["retained"]["regressions"]:
        out.append(f"retained {reg['topic']} on {reg['node']}: {reg['got']} < last "
                   f"acknowledged {reg['last_acked']}")
    if r["crashes"]["unexpected_exits"] or r["crashes"]["tracebacks"]:
        out.append(f"crashes: {r['crashes']} (see {r.get('dir')}/nI.log)")
    if r.get("harness_errors"):
        out.append(f"harness errors: {r['harness_errors']}")
    return out


def outer(args: argparse.Namespace, argv: list[str]) -> int:
    ok, why = netns.can_create_namespaces()
    if not ok:
        print(f"fault suite cannot run: {why}", file=sys.stderr)
        return 2
    stale = netns.remove_stale()
    if stale:
        print(f"[faults] removed leftovers of earlier runs: {stale}", flush=True)
    sizes = [int(n) for n in str(args.nodes).split(",")]
    # One namespace more than the largest cluster: the node that the ``join`` scenario adds.
    topology = netns.Topology([f"n{i}" for i in range(1, max(sizes) + 2)])
    child: list[subprocess.Popen[bytes]] = []

    def cleanup() -> None:
        for proc in child:
            if proc.poll() is None:
                proc.kill()
                # Run from a signal handler while the main thread is in ``wait`` itself,
                # this wait cannot take the Popen's lock and always times out: it used to
                # end the cleanup there, leaving the nodes running in their namespaces.
                # ``teardown`` kills everything in them, the inner run included.
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
        topology.teardown()

    def on_signal(signum: int, frame: Any) -> None:
        cleanup()
        raise SystemExit(128 + signum)

    atexit.register(cleanup)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").unlink(missing_ok=True)
    try:
        topology.setup()
        cmd = [netns.IP, "netns", "exec", topology.client, sys.executable, "-m",
               "tests.faults.run", *argv, "--inner", "--topology",
               json.dumps(topology.to_dict())]
        child.append(subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}))
        try:
            rc = child[0].wait(OVERALL_BOUND)
        except subprocess.TimeoutExpired:
            print(f"[faults] inner run exceeded {OVERALL_BOUND} s; killed", file=sys.stderr)
            rc = 2
    finally:
        cleanup()
    report = args.out / "report.json"
    if not report.exists():
        print("[faults] no report written", file=sys.stderr)
        return 2
    summary = json.loads(report.read_text())
    text = markdown(summary)
    (args.out / "report.md").write_text(text)
    if args.md:
        args.md.write_text(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(report.read_text())
    print(text)
    return 0 if summary["ok"] and rc == 0 else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    plan(args)  # validate before building anything
    return inner(args) if args.inner else outer(args, argv)


if __name__ == "__main__":
    sys.exit(main())
