"""``python -m benchmarks scaleout``: does mqttring scale with cores, against mosquitto?

One run, one machine, three set-ups, the same load on each:

* **mosquitto** (one process, one core: its design);
* **mqttring, one node**;
* **mqttring, N workers** (``python -m mqttring.node --workers N``: N node processes, one
  cluster, one port shared with ``SO_REUSEPORT``);
* **mqttring, 2 nodes, A to B** (two nodes started apart, one cluster): every publisher on
  node A, every subscriber on node B, so every message crosses the cluster (half of them
  accepted by A as their owner and delivered to B, half forwarded to B as the owner: the
  streams' topics are placed so, ``placed_topics``).

The load is K independent streams, each a publisher and a subscriber on a topic of its own
(``bench/<run>/so<qos>/<k>``), at QoS 0 and then QoS 1.  Every client connects to the one
port, so on the workers set-up the kernel spreads them over the nodes regardless of which
node owns which topic: most publishes take the cluster's extra hop, as they would behind a
load balancer.  A latency probe (one publisher and one subscriber in one process, QoS 0 at
200 msg/s) runs beside the streams, so its p50/p99 are latencies *under* that load.

Reported per set-up and QoS: total deliveries/s, acknowledged-but-lost messages, broker CPU
seconds per delivery (all broker processes: the supervisor and every worker), p50/p99 of the
probe, and each figure's ratio to mosquitto's in the same run.  Defaults follow the
machine: K = 2 x cores streams (at least 4), N = cores / 4 workers (at least 2); on a
2-core machine the load generator competes with the brokers for the same cores, which the
CPU split in the JSON shows (``generator_s``, ``other_s``).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.brokers import BrokerHandle, _fail, mqttring_version, start_mosquitto
from benchmarks.loadgen import ACKED, DONE, DUPS, ERROR, GO, PHASE, RECV, SENT, STOP, WRITEOFF
from benchmarks.scenarios import CpuMeter, Params, Run, _base, _proc_cpu, broker_pids

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class WorkersHandle(BrokerHandle):
    """A ``--workers`` supervisor: stopping it stops its workers (bounded, then killed)."""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(45)  # it stops its workers (and kills stragglers) itself
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: workers too
                self.proc.wait(5)
        super().stop()


def start_workers(count: int) -> BrokerHandle:
    h = WorkersHandle(f"mqttring-w{count}", version=mqttring_version())
    h.tmpdir = tempfile.mkdtemp(prefix="bench-workers-")
    ready = Path(h.tmpdir) / "ready.json"
    with open(Path(h.tmpdir) / "stderr.log", "wb") as err:
        h.proc = subprocess.Popen(
            [sys.executable, "-m", "mqttring.node", "--workers", str(count),
             "--mqtt", "127.0.0.1:0", "--data-dir", str(Path(h.tmpdir) / "data"),
             "--sys-interval", "0", "--log-level", "warning", "--ready-file", str(ready)],
            stdout=err, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=h.tmpdir,
            start_new_session=True)
    h.pid = h.proc.pid
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if not h.alive():
            return _fail(h, "the workers' supervisor exited before it was ready")
        try:
            info = json.loads(ready.read_text())
            break
        except (FileNotFoundError, json.JSONDecodeError):
            time.sleep(0.1)
    else:
        return _fail(h, "workers not ready within 90 s")
    h.port = int(info["mqtt"])
    # The supervisor's CPU figure includes its children, the workers: counting them again
    # would double the broker's CPU (figures before 2026-11-23T0800Z did).
    h.extra["pids"] = [h.pid]
    h.extra["node_pids"] = [int(w["pid"]) for w in info["workers"]]
    h.extra["workers"] = count
    return h


@dataclass
class PairHandle(BrokerHandle):
    """Two nodes of one cluster: publishers connect to the first, subscribers to the
    second (``sub_target``)."""

    nodes: list[BrokerHandle] = field(default_factory=list)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def start_pair() -> BrokerHandle:
    from benchmarks.cluster import start_nodes, topic_owners, wait_settled

    h = PairHandle("mqttring-2n-a2b", version=mqttring_version())
    try:
        h.nodes = start_nodes(2, secrets.token_hex(16), sys_interval=0)
        wait_settled(h.nodes[0])
        h.extra["owner_of"] = topic_owners(h.nodes[0])
    except Exception as exc:  # a benchmark reports why a set-up did not run
        h.stop()
        h.unavailable = f"2-node cluster did not start: {exc}"
        return h
    first, second = h.nodes
    h.port, h.pid = first.port, first.pid
    h.extra["pids"] = h.extra["node_pids"] = [n.pid for n in h.nodes]
    h.extra["sub_target"] = second
    return h


def start_node() -> BrokerHandle:
    from benchmarks.brokers import start_mqttring

    return start_mqttring()


def placed_topics(topics: list[str], owner_of: Callable[[str], str | None],
                  owners: list[str]) -> list[str]:
    """``topics`` renamed (a suffix) so that stream k's topic is owned by ``owners[k % n]``.

    With the hash left to decide, four streams' owners are a coin toss each: one run of the
    pair had every topic owned by A (no forwarded ``Pub`` at all), the next one in four, and
    the two paths cost differently, so runs of one code differed by a fifth.  Placed, every
    run takes both paths equally (the split the module docstring describes).
    """
    placed = []
    for k, topic in enumerate(topics):
        want = owners[k % len(owners)]
        for attempt in range(10_000):
            candidate = f"{topic}-{attempt}"
            if owner_of(candidate) == want:
                placed.append(candidate)
                break
        else:
            raise RuntimeError(f"no topic near {topic!r} is owned by {want}")
    return placed


def streams_run(broker: BrokerHandle, p: Params, qos: int, streams: int,
                run_id: str) -> dict[str, Any]:
    """K publisher/subscriber pairs on distinct topics, plus the latency probe."""
    tag = f"{run_id}-so{qos}"
    topics = [f"bench/{run_id}/so{qos}/{k}" for k in range(streams)]
    owner_of = broker.extra.get("owner_of")
    if callable(owner_of):
        topics = placed_topics(topics, owner_of, ["node1", "node2"])
    sub_target = broker.extra.get("sub_target", broker)
    assert isinstance(sub_target, BrokerHandle)
    subs = [_base(sub_target, "sub", tag, p, filters=[[t] for t in topics], qos=qos)]
    pubs = [_base(broker, "pub", f"{tag}-{k}", p, topics=[t], qos=qos,
                  batch=16 if qos else 32, window=400 if qos else 2000, inflight=100)
            for k, t in enumerate(topics)]
    probe = _base(broker, "latency", f"{tag}-lat", p, topics=[f"bench/{run_id}/lat{qos}"],
                  rate=200.0, max_msgs=int(200 * (p.warmup_s + p.measure_s + 5)))
    n_sub = len(subs)
    pub_slots = list(range(n_sub, n_sub + len(pubs)))
    specs = [replace(s, pub_slots=pub_slots, sub_slots=list(range(n_sub)), fanout=1)
             for s in subs + pubs] + [probe]
    budget = p.setup_timeout + p.warmup_s + p.measure_s + p.drain_s + 15
    with Run(specs, budget) as run:
        err = run.wait_ready(p.setup_timeout)
        if err:
            return {"status": "failed", "error": f"setup: {err}"}
        pids = broker_pids(broker)
        meter = CpuMeter(pids, [pr.pid for pr in run.procs if pr.pid])
        run.ctl[PHASE] = GO
        time.sleep(p.warmup_s)
        a, r0 = meter.snap(), run.total(RECV, "sub")
        nodes = broker.extra.get("node_pids", pids)
        assert isinstance(nodes, list)
        each_a = [_proc_cpu(pid) for pid in nodes]
        time.sleep(p.measure_s)
        b, r1 = meter.snap(), run.total(RECV, "sub")
        each_b = [_proc_cpu(pid) for pid in nodes]
        run.ctl[PHASE] = STOP
        deadline = time.monotonic() + p.drain_s
        while time.monotonic() < deadline and not run.total(ERROR):
            sent = run.total(SENT, "pub") - run.total(WRITEOFF, "pub")
            if run.total(RECV, "sub") - run.total(DUPS, "sub") >= sent:
                break
            time.sleep(0.02)
        run.ctl[PHASE] = DONE
        errors = run.collect(10)
        sent, acked = run.total(SENT, "pub"), run.total(ACKED, "pub")
        recv, dups = run.total(RECV, "sub"), run.total(DUPS, "sub")
        probe_result = run.collected.get(len(specs) - 1, {})
    lost = max(0, (acked if qos else sent) - (recv - dups))
    deliveries = r1 - r0
    cpu = CpuMeter.diff(a, b)
    lat = sorted(probe_result.get("latencies_ns", []))

    def pct(q: float) -> float | None:
        return round(lat[min(len(lat) - 1, int(q * len(lat)))] / 1e6, 3) if lat else None

    out: dict[str, Any] = {
        "status": "ok", "qos": qos, "streams": streams,
        "deliveries_per_s": round(deliveries / (b[0] - a[0]), 1),
        "sent": sent, "acked": acked if qos else None, "received": recv, "duplicates": dups,
        "lost": lost,
        "cpu_us_per_delivery": round(cpu["broker_s"] / deliveries * 1e6, 2)
        if deliveries else None,
        "latency_p50_ms": pct(0.50), "latency_p99_ms": pct(0.99),
        "cpu": cpu,
        # Per node process (node A first for a pair): what each would need of a core of its
        # own, the per-node cost model of docs/design.md.
        "cpu_us_per_delivery_by_node": [round((y - x) / deliveries * 1e6, 2)
                                           for x, y in zip(each_a, each_b, strict=True)]
        if deliveries else None,
    }
    if errors:
        out.update(status="failed", error="; ".join(errors))
    elif qos and lost:
        out.update(status="failed", error=f"QoS 1 loss: {lost} acknowledged messages")
    elif not deliveries:
        out.update(status="failed", error="no deliveries during the measuring window")
    return out


def ratios(results: dict[str, Any]) -> None:
    """Each mqttring figure divided by mosquitto's for the same QoS, and each cluster's
    deliveries/s divided by one node's (same run; with ``--repeat``, same round)."""
    setups = results["setups"]
    for name, setup in setups.items():
        base_name, _, round_no = name.partition("#")
        suffix = f"#{round_no}" if round_no else ""
        mosquitto = setups.get(f"mosquitto{suffix}", {}).get("runs", {})
        one_node = setups.get(f"mqttring{suffix}", {}).get("runs", {})
        for qos, run in setup.get("runs", {}).items():
            if run.get("status") != "ok":
                continue
            ref = mosquitto.get(qos)
            if base_name != "mosquitto" and ref and ref.get("status") == "ok":
                run["vs_mosquitto"] = {
                    key: round(run[key] / ref[key], 2)
                    for key in ("deliveries_per_s", "cpu_us_per_delivery", "latency_p99_ms")
                    if run.get(key) and ref.get(key)
                }
            single = one_node.get(qos)
            if (base_name not in ("mosquitto", "mqttring") and single
                    and single.get("status") == "ok" and single.get("deliveries_per_s")):
                run["vs_one_node"] = round(run["deliveries_per_s"]
                                           / single["deliveries_per_s"], 2)


def markdown(results: dict[str, Any]) -> str:
    lines = [f"# Scale-out {results['stamp']}: {results['streams']} streams, "
             f"{results['cores']} cores",
             "",
             "| set-up | QoS | deliveries/s | x mosquitto | x one node | lost | "
             "broker CPU us/delivery | x mosquitto | per node | p50 ms | p99 ms | x mosquitto |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, setup in results["setups"].items():
        if setup.get("unavailable"):
            lines.append(f"| {name} | | not run: {setup['unavailable']} ||||||||")
            continue
        for qos, run in setup["runs"].items():
            if run.get("status") != "ok":
                lines.append(f"| {name} | {qos} | failed: {run.get('error')} ||||||||")
                continue
            vs = run.get("vs_mosquitto", {})
            lines.append(
                f"| {name} | {qos} | {run['deliveries_per_s']:,.0f} | "
                f"{vs.get('deliveries_per_s', '')} | {run.get('vs_one_node', '')} | "
                f"{run['lost']} | "
                f"{run['cpu_us_per_delivery']} | {vs.get('cpu_us_per_delivery', '')} | "
                f"{' / '.join(map(str, run.get('cpu_us_per_delivery_by_node') or []))} | "
                f"{run['latency_p50_ms']} | {run['latency_p99_ms']} | "
                f"{vs.get('latency_p99_ms', '')} |")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [n for n, s in results["setups"].items() if not s.get("unavailable")]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, qos in zip(axes, ("0", "1"), strict=True):
        values = [results["setups"][n]["runs"].get(qos, {}).get("deliveries_per_s") or 0
                  for n in names]
        ax.bar(names, values)
        ax.set_title(f"QoS {qos}: deliveries/s, {results['streams']} streams")
        ax.tick_params(axis="x", rotation=15)
    fig.suptitle(f"scale-out {results['stamp']} ({results['cores']} cores)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    cores = os.cpu_count() or 1
    parser = argparse.ArgumentParser(prog="python -m benchmarks scaleout",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=max(4, 2 * cores))
    parser.add_argument("--workers", type=int, default=max(2, cores // 4))
    parser.add_argument("--quick", action="store_true", help="short measuring windows")
    parser.add_argument("--setups", help="comma list of set-ups to run (default: all): "
                        "mosquitto,mqttring,mqttring-wN,mqttring-2n-a2b")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the set-ups this many times, interleaved (this machine's "
                        "figures drift between runs; ratios are fairest between neighbours)")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    p = Params.quick() if args.quick else Params()
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H%M%SZ")
    run_id = uuid.uuid4().hex[:6]
    results: dict[str, Any] = {"stamp": stamp, "cores": cores, "streams": args.streams,
                               "workers": args.workers, "params": p.__dict__, "setups": {}}
    setups = [("mosquitto", start_mosquitto), ("mqttring", start_node),
              (f"mqttring-w{args.workers}", lambda: start_workers(args.workers)),
              ("mqttring-2n-a2b", start_pair)]
    if args.setups:
        wanted = args.setups.split(",")
        setups = [(name, start) for name, start in setups if name in wanted]
    if args.repeat > 1:
        setups = [(f"{name}#{k}", start) for k in range(1, args.repeat + 1)
                  for name, start in setups]
    for name, start in setups:
        print(f"{name}: starting", flush=True)
        handle = start()
        try:
            if handle.unavailable:
                print(f"  not run: {handle.unavailable}", flush=True)
                results["setups"][name] = {"unavailable": handle.unavailable}
                continue
            runs: dict[str, Any] = {}
            for qos in (0, 1):
                runs[str(qos)] = r = streams_run(handle, p, qos, args.streams, run_id)
                print(f"  QoS {qos}: {r.get('deliveries_per_s')} deliveries/s, lost "
                      f"{r.get('lost')}, p99 {r.get('latency_p99_ms')} ms "
                      f"{r.get('error', '')}", flush=True)
            results["setups"][name] = {"version": handle.version, "runs": runs}
        finally:
            handle.stop()
    ratios(results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = out / f"scaleout-{stamp}"
    base.with_suffix(".json").write_text(json.dumps(results, indent=1))
    text = markdown(results)
    base.with_suffix(".md").write_text(text)
    plotted = plot(results, base.with_suffix(".png"))
    print(text)
    print(f"wrote {base}.json, .md{', .png' if plotted else ''}")
    failed = any(r.get("status") != "ok" for s in results["setups"].values()
                 for r in s.get("runs", {}).values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
