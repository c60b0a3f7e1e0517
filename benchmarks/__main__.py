"""``python -m benchmarks compare``: every scenario on every broker, one run, one machine.

Why one command runs all brokers: figures from different days or machines are not
comparable, so ratios (and the issue's targets) are only computed between brokers measured
in the same run.  Brokers run one at a time, never concurrently, each on its own free
port, and are stopped in ``finally`` blocks whatever happens.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

from benchmarks import cluster, loadgen, report, scenarios
from benchmarks.brokers import REPO, STARTERS, BrokerHandle, attach_target
from benchmarks.scenarios import Params

RESULTS = Path(__file__).resolve().parent / "results"

Scenario = Callable[[BrokerHandle, Params, str], dict[str, Any]]
#: Run order matters: ``idle`` first, on a fresh broker, because throughput scenarios grow a
#: broker's heap and freed memory is then reused by new connections (mosquitto showed 0 KB
#: per connection after the throughput runs); ``latency`` second, before any backlog.
SCENARIOS: dict[str, Scenario] = {
    "idle": scenarios.idle,
    "latency": scenarios.latency,
    "fanin_qos0": lambda b, p, r: scenarios.fan_in(b, p, 0, r),
    "fanin_qos1": lambda b, p, r: scenarios.fan_in(b, p, 1, r),
    "fanout": scenarios.fan_out,
    "wildcard": scenarios.wildcard,
    "retained": scenarios.retained,
    "cluster": cluster.run,
}


def machine_facts() -> dict[str, Any]:
    model = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    commit = "unknown"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    return {
        "cores_logical": psutil.cpu_count(),
        "cores_physical": psutil.cpu_count(logical=False),
        "cpu_model": model,
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
        "nofile_limit": loadgen.raise_nofile(),
        "commit": commit,
    }


def run_broker(handle: BrokerHandle, names: list[str], p: Params, run_id: str) -> dict[str, Any]:
    """All scenarios on one started broker; a dead broker fails the rest explicitly."""
    out: dict[str, Any] = {
        "version": handle.version,
        "port": handle.port,
        "pid": handle.pid,
        "scenarios": {},
    }
    for name in names:
        if not handle.alive():
            code = handle.proc.returncode if handle.proc else "?"
            tail = handle.stderr_tail().strip()[-300:]
            result = {
                "status": "failed",
                "error": f"broker process exited (code {code}) before this scenario"
                + (f"; stderr: {tail}" if tail else ""),
            }
        else:
            t0 = time.monotonic()
            try:
                result = SCENARIOS[name](handle, p, f"{run_id}{name[:3]}")
            except Exception as exc:  # a harness bug must not hide the other figures
                result = {
                    "status": "failed",
                    "error": f"harness error: {exc!r}",
                    "traceback": traceback.format_exc()[-1500:],
                }
            result["wall_s"] = round(time.monotonic() - t0, 2)
            if not handle.alive():
                code = handle.proc.returncode if handle.proc else "?"
                died = f"broker died during the scenario (exit {code})"
                result.update(status="failed", error=f"{result.get('error') or ''} {died}".strip())
        out["scenarios"][name] = result
        print(f"  {handle.name:10s} {name:11s} {_summary(result)}", flush=True)
    return out


def _summary(r: dict[str, Any]) -> str:
    if r.get("status") != "ok":
        return f"{r.get('status', '?').upper()}: {r.get('error') or r.get('reason')}"
    for key in ("deliveries_per_s", "p99_ms", "rss_per_conn_kb", "receive_all_s"):
        if key in r:
            extra = f" p50 {r['p50_ms']} ms" if key == "p99_ms" else ""
            extra += f", {r['connects_per_s']} conn/s" if key == "rss_per_conn_kb" else ""
            return f"{key}={r[key]}{extra} lost={r.get('lost', 0)} ({r.get('wall_s')} s)"
    return "ok"


def save_stderr(handle: BrokerHandle, out_dir: Path, stamp: str) -> str | None:
    """Keep a failed broker's own log next to the report: the error text alone is a tail."""
    if not handle.tmpdir:
        return None
    src = Path(handle.tmpdir) / "stderr.log"
    if not src.exists() or not src.stat().st_size:
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    dst = out_dir / f"{stamp}-{handle.name}-stderr.log"
    dst.write_bytes(src.read_bytes()[-200_000:])
    return str(dst)


def compare(args: argparse.Namespace) -> int:
    loadgen.raise_nofile()  # brokers we start inherit it: 10,000 idle connections need fds
    p = Params.quick() if args.quick else Params()
    requested = [s for s in args.scenarios.split(",") if s]
    unknown = set(requested) - set(SCENARIOS)
    names = [s for s in SCENARIOS if s in requested]  # always in the documented order
    if unknown:
        print(f"unknown scenarios: {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    run_id = uuid.uuid4().hex[:6]
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H%M%SZ")
    t_start = time.monotonic()
    results: dict[str, Any] = {
        "stamp": stamp,
        "mode": "quick" if args.quick else "full",
        "params": p.__dict__,
        "machine": machine_facts(),
        "brokers": {},
    }
    if not args.no_sink:
        print("generator ceiling (sink) ...", flush=True)
        results["generator_ceiling"] = scenarios.generator_ceiling(p)
        gc = results["generator_ceiling"]
        print(
            f"  publish {gc.get('publish_msgs_per_s')} msg/s, read "
            f"{gc.get('read_msgs_per_s')} msg/s",
            flush=True,
        )
    plan: list[tuple[str, Callable[[], BrokerHandle]]] = []
    if args.target:
        plan += [(t, lambda t=t: attach_target(t)) for t in args.target]
    if args.brokers or not args.target:
        for b in (args.brokers or "mqttring,mosquitto,amqtt").split(","):
            if b not in STARTERS:
                print(f"unknown broker {b!r}; choose from {', '.join(STARTERS)}", file=sys.stderr)
                return 2
            plan.append((b, STARTERS[b]))
    for name, start in plan:
        print(f"{name}: starting", flush=True)
        handle = BrokerHandle(name)
        try:
            handle = start()
            if handle.unavailable:
                print(f"  not run: {handle.unavailable}", flush=True)
                results["brokers"][handle.name] = {
                    "version": handle.version,
                    "unavailable": handle.unavailable,
                }
                continue
            results["brokers"][handle.name] = entry = run_broker(handle, names, p, run_id)
            if any(s.get("status") == "failed" for s in entry["scenarios"].values()):
                entry["stderr_log"] = save_stderr(handle, Path(args.out), stamp)
        finally:
            handle.stop()
    results["total_wall_s"] = round(time.monotonic() - t_start, 1)
    paths = report.write(results, Path(args.out))
    print()
    print(report.markdown(results))
    print("wrote " + ", ".join(str(x) for x in paths) + f" in {results['total_wall_s']} s")
    failed = any(
        s.get("status") == "failed"
        for b in results["brokers"].values()
        for s in b.get("scenarios", {}).values()
    )
    return 1 if failed and args.strict else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compare", help="run the scenarios on each broker and write the report")
    c.add_argument("--quick", action="store_true", help="short durations, 1,000 idle connections")
    c.add_argument(
        "--target",
        action="append",
        metavar="[NAME=]HOST:PORT",
        help="measure a running broker (repeatable); naming one 'mqttring' makes "
        "the targets apply to it",
    )
    c.add_argument(
        "--brokers",
        help="comma list of brokers to start: mqttring,mosquitto,amqtt "
        "(default: all three, unless --target is given)",
    )
    c.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help=f"comma list (default all): {','.join(SCENARIOS)}",
    )
    c.add_argument("--out", default=str(RESULTS), help="directory for JSON/markdown/PNG")
    c.add_argument("--no-sink", action="store_true", help="skip the generator-ceiling check")
    c.add_argument("--strict", action="store_true", help="exit 1 if any scenario failed")
    c.set_defaults(func=compare)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["scaleout"]:
        from benchmarks import scaleout  # its own options (see its docstring)

        return scaleout.main(argv[1:])
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
