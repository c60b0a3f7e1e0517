"""Scenario orchestration: start workers, open the measuring window, account CPU, count loss.

Every scenario returns a plain dict (it goes straight into the JSON).  Common keys:
``status`` ("ok", "failed", "not available"), ``error`` when not ok, the headline figure under
a scenario-specific name, ``lost`` and ``cpu`` (CPU seconds of the broker, the generator, and
everything else on the machine during the measuring window, so that a noisy run is visible).

Why a measuring window instead of whole-run totals: connection set-up, process start and
the final drain are not throughput.  Rates are counter deltas between two snapshots taken
after a warm-up while the load is steady.  Loss is counted over the whole run, after a drain.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

import psutil

from benchmarks import loadgen, sink
from benchmarks.brokers import BrokerHandle
from benchmarks.loadgen import (
    ACKED,
    DONE,
    DUPS,
    ERROR,
    GO,
    PHASE,
    READY,
    RECV,
    SENT,
    STALLS,
    STOP,
    WRITEOFF,
    WorkerSpec,
    slot_base,
)

CTX = mp.get_context("spawn")


@dataclass(frozen=True)
class Params:
    """Durations and sizes; ``quick()`` keeps a three-broker run under two minutes."""

    warmup_s: float = 1.0
    measure_s: float = 10.0
    drain_s: float = 5.0
    latency_s: float = 20.0
    idle_connections: int = 10_000
    retained_topics: int = 10_000
    wildcard_filters: int = 1_000
    fanout_subscribers: int = 100
    payload: int = 64
    setup_timeout: float = 30.0
    retained_limit_s: float = 120.0

    @classmethod
    def quick(cls) -> Params:
        return cls(
            warmup_s=0.3,
            measure_s=1.5,
            drain_s=2.0,
            latency_s=2.5,
            idle_connections=1_000,
            retained_topics=2_000,
            retained_limit_s=20.0,
            setup_timeout=15.0,
        )


def _busy(ct: Any) -> float:
    return ct.user + ct.nice + ct.system + ct.irq + ct.softirq


def _proc_cpu(pid: int | None) -> float:
    """CPU seconds of ``pid`` and its live children (0 if it is gone or unknown)."""
    if pid is None:
        return 0.0
    total = 0.0
    try:
        p = psutil.Process(pid)
        for q in [p, *p.children(recursive=True)]:
            try:
                t = q.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
    except psutil.Error:
        pass
    return total


def proc_rss(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        p = psutil.Process(pid)
        return sum(q.memory_info().rss for q in [p, *p.children(recursive=True)])
    except psutil.Error:
        return None


def broker_pids(broker: BrokerHandle) -> list[int | None]:
    """All processes whose CPU is the broker's: one node, or every node of a cluster."""
    pids = broker.extra.get("pids")
    return list(pids) if isinstance(pids, list) else [broker.pid]


class CpuMeter:
    """System busy CPU split into broker, generator (workers + this process) and other."""

    def __init__(self, broker_pids: list[int | None], gen_pids: list[int]) -> None:
        self.broker_pids = broker_pids
        self.gen_pids = gen_pids

    def snap(self) -> tuple[float, float, float, float]:
        gen = sum(_proc_cpu(p) for p in self.gen_pids)
        me = psutil.Process().cpu_times()
        gen += me.user + me.system
        broker = sum(_proc_cpu(p) for p in self.broker_pids)
        return time.monotonic(), _busy(psutil.cpu_times()), broker, gen

    @staticmethod
    def diff(a: tuple[float, ...], b: tuple[float, ...]) -> dict[str, float]:
        elapsed, busy, broker, gen = (b[i] - a[i] for i in range(4))
        return {
            "elapsed_s": round(elapsed, 3),
            "broker_s": round(broker, 3),
            "generator_s": round(gen, 3),
            "other_s": round(max(0.0, busy - broker - gen), 3),
            "system_busy_s": round(busy, 3),
        }


class Run:
    """One set of worker processes sharing one counter array; always cleaned up."""

    def __init__(self, specs: list[WorkerSpec], max_seconds: float) -> None:
        self.specs = [replace(s, index=i, max_seconds=max_seconds) for i, s in enumerate(specs)]
        self.ctl = CTX.RawArray("q", loadgen.HEADER + loadgen.SLOT * len(specs))
        self.results: Any = CTX.Queue()
        self.procs = [
            CTX.Process(target=loadgen.run_worker, args=(s, self.ctl, self.results), daemon=True)
            for s in self.specs
        ]
        self.collected: dict[int, dict[str, Any]] = {}

    def __enter__(self) -> Run:
        for p in self.procs:
            p.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.ctl[PHASE] = DONE
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.terminate()
                p.join(2)

    def total(self, counter: int, role: str | None = None) -> int:
        return sum(
            self.ctl[slot_base(s.index) + counter]
            for s in self.specs
            if role is None or s.role == role
        )

    def errors(self) -> list[str]:
        """Drain the result queue; return error texts of failed workers."""
        while True:
            try:
                r = self.results.get_nowait()
            except queue.Empty:
                break
            self.collected[r["index"]] = r
        return [
            f"{r['role']}#{r['index']}: {r['error']}"
            for r in self.collected.values()
            if not r["ok"]
        ]

    def wait_ready(self, timeout: float) -> str | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.total(ERROR):
                time.sleep(0.1)
                return "; ".join(self.errors()) or "a worker failed"
            if all(self.ctl[slot_base(s.index) + READY] for s in self.specs):
                return None
            dead = [p for p in self.procs if not p.is_alive()]
            if dead and not all(self.ctl[slot_base(s.index) + READY] for s in self.specs):
                time.sleep(0.1)
                return "; ".join(self.errors()) or f"worker exited with code {dead[0].exitcode}"
            time.sleep(0.01)
        return f"workers not connected/subscribed within {timeout:.0f} s"

    def collect(self, timeout: float) -> list[str]:
        deadline = time.monotonic() + timeout
        while len(self.collected) < len(self.specs) and time.monotonic() < deadline:
            try:
                r = self.results.get(timeout=0.1)
                self.collected[r["index"]] = r
            except queue.Empty:
                if not any(p.is_alive() for p in self.procs):
                    break
        return self.errors()


def _fail(error: str, **extra: Any) -> dict[str, Any]:
    return {"status": "failed", "error": error, **extra}


def stream(
    broker: BrokerHandle,
    p: Params,
    pubs: list[WorkerSpec],
    subs: list[WorkerSpec],
    fanout: int,
    qos: int,
) -> dict[str, Any]:
    """Closed-loop publishers -> subscribers; the shape of fan-in, fan-out and wildcard."""
    specs = subs + pubs
    n_sub = len(subs)
    pub_slots = list(range(n_sub, len(specs)))
    sub_slots = list(range(n_sub))
    specs = [replace(s, pub_slots=pub_slots, sub_slots=sub_slots, fanout=fanout) for s in specs]
    budget = p.setup_timeout + p.warmup_s + p.measure_s + p.drain_s + 10
    with Run(specs, budget) as run:
        err = run.wait_ready(p.setup_timeout)
        if err:
            return _fail(f"setup: {err}")
        meter = CpuMeter(broker_pids(broker), [pr.pid for pr in run.procs if pr.pid])
        run.ctl[PHASE] = GO
        time.sleep(p.warmup_s)
        a, r0, s0 = meter.snap(), run.total(RECV, "sub"), run.total(SENT, "pub")
        time.sleep(p.measure_s)
        b, r1, s1 = meter.snap(), run.total(RECV, "sub"), run.total(SENT, "pub")
        run.ctl[PHASE] = STOP
        time.sleep(0.05)
        # Drain: until everything sent has been delivered (bounded).  Not "until everything
        # acknowledged": publishers are still reading their last PUBACKs at this point.
        deadline = time.monotonic() + p.drain_s
        while time.monotonic() < deadline and not run.total(ERROR):
            sent = run.total(SENT, "pub") - run.total(WRITEOFF, "pub")
            if run.total(RECV, "sub") - run.total(DUPS, "sub") >= sent * fanout:
                break
            time.sleep(0.02)
        time.sleep(0.05)
        run.ctl[PHASE] = DONE
        errors = run.collect(10)
        sent, acked = run.total(SENT, "pub"), run.total(ACKED, "pub")
        recv, dups = run.total(RECV, "sub"), run.total(DUPS, "sub")
        basis = acked if qos else sent
        lost = max(0, basis * fanout - (recv - dups))
        out: dict[str, Any] = {
            "status": "ok",
            "qos": qos,
            "publishers": len(pubs),
            "fanout": fanout,
            "deliveries_per_s": round((r1 - r0) / (b[0] - a[0]), 1),
            "publishes_per_s": round((s1 - s0) / (b[0] - a[0]), 1),
            "sent": sent,
            "acked": acked if qos else None,
            "received": recv,
            "duplicates": dups,
            "lost": lost,
            "stalls": run.total(STALLS, "pub"),
            "written_off": run.total(WRITEOFF, "pub"),
            "cpu": CpuMeter.diff(a, b),
        }
        if errors:
            out.update(status="failed", error="; ".join(errors))
        elif qos and lost:
            out.update(
                status="failed", error=f"QoS 1 loss: {lost} acknowledged deliveries never arrived"
            )
        elif r1 == r0:
            out.update(status="failed", error="no deliveries during the measuring window")
        return out


def _base(broker: BrokerHandle, role: str, tag: str, p: Params, **kw: Any) -> WorkerSpec:
    return WorkerSpec(
        role=role,
        index=0,
        host=broker.host,
        port=broker.port,
        client_prefix=f"bench-{tag}",
        payload_size=p.payload,
        **kw,
    )


def fan_in(broker: BrokerHandle, p: Params, qos: int, run_id: str) -> dict[str, Any]:
    topic = f"bench/{run_id}/fanin{qos}"
    subs = [_base(broker, "sub", f"{run_id}-fi{qos}", p, filters=[[topic]], qos=qos)]
    pub = _base(
        broker,
        "pub",
        f"{run_id}-fi{qos}",
        p,
        topics=[topic],
        qos=qos,
        batch=16 if qos else 32,
        window=400 if qos else 2000,
        inflight=100,
    )
    return stream(broker, p, [pub] * 4, subs, 1, qos)


def fan_out(broker: BrokerHandle, p: Params, run_id: str) -> dict[str, Any]:
    topic = f"bench/{run_id}/fanout"
    n = p.fanout_subscribers
    half = n // 2
    groups = [[[topic]] * half, [[topic]] * (n - half)]
    subs = [_base(broker, "sub", f"{run_id}-fo", p, filters=g) for g in groups if g]
    pub = _base(broker, "pub", f"{run_id}-fo", p, topics=[topic], batch=4, window=40)
    return stream(broker, p, [pub], subs, n, 0)


def wildcard(broker: BrokerHandle, p: Params, run_id: str) -> dict[str, Any]:
    """1,000 filters (half ``+``, half ``#``) over 10 connections; each publish matches one."""
    base = f"bench/{run_id}/wc"
    n = p.wildcard_filters
    filters = [f"{base}/{i}/+/data" if i % 2 == 0 else f"{base}/{i}/#" for i in range(n)]
    topics = [f"{base}/{i}/x/data" for i in range(n)]
    per = max(1, n // 10)
    groups = [filters[i : i + per] for i in range(0, n, per)]
    subs = [_base(broker, "sub", f"{run_id}-wc", p, filters=groups)]
    pubs = [
        _base(broker, "pub", f"{run_id}-wc", p, topics=topics[k::2], batch=32, window=2000)
        for k in range(2)
    ]
    out = stream(broker, p, pubs, subs, 1, 0)
    out["filters"] = n
    return out


def latency(broker: BrokerHandle, p: Params, run_id: str, rate: float = 200.0) -> dict[str, Any]:
    spec = _base(
        broker,
        "latency",
        f"{run_id}-lat",
        p,
        topics=[f"bench/{run_id}/lat"],
        rate=rate,
        max_msgs=int(rate * p.latency_s) + 1,
    )
    with Run([spec], p.setup_timeout + p.latency_s + 10) as run:
        err = run.wait_ready(p.setup_timeout)
        if err:
            return _fail(f"setup: {err}")
        meter = CpuMeter(broker_pids(broker), [pr.pid for pr in run.procs if pr.pid])
        a = meter.snap()
        run.ctl[PHASE] = GO
        time.sleep(p.latency_s)
        b = meter.snap()
        run.ctl[PHASE] = STOP
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and run.total(RECV) < run.total(SENT):
            time.sleep(0.02)
        run.ctl[PHASE] = DONE
        errors = run.collect(10)
        if errors:
            return _fail("; ".join(errors))
        r = run.collected.get(0, {})
    lat = sorted(r.get("latencies_ns", []))
    if not lat:
        return _fail("no message came back")

    def pct(q: float) -> float:
        return round(lat[min(len(lat) - 1, int(q * len(lat)))] / 1e6, 3)

    return {
        "status": "ok",
        "rate_per_s": rate,
        "sent": r["sent"],
        "received": len(lat),
        "lost": max(0, r["sent"] - len(lat)),
        "p50_ms": pct(0.50),
        "p99_ms": pct(0.99),
        "max_ms": round(lat[-1] / 1e6, 3),
        "cpu": CpuMeter.diff(a, b),
    }


def idle(broker: BrokerHandle, p: Params, run_id: str) -> dict[str, Any]:
    """N idle connections: connects/s and broker RSS growth per connection."""
    n = p.idle_connections
    procs = max(1, min(4, n // 2500))
    rss0 = proc_rss(broker.pid)
    specs = [
        _base(
            broker,
            "idle",
            f"{run_id}-idle",
            p,
            connections=n // procs + (k < n % procs),
            connect_timeout=max(10.0, n / 200),
        )
        for k in range(procs)
    ]
    with Run(specs, p.setup_timeout + n / 100 + 20) as run:
        meter = CpuMeter(broker_pids(broker), [pr.pid for pr in run.procs if pr.pid])
        a = meter.snap()
        err = run.wait_ready(max(15.0, n / 150))
        b = meter.snap()
        if err:
            return _fail(f"connecting: {err}")
        time.sleep(0.5)  # let the broker settle its per-connection buffers
        rss1 = proc_rss(broker.pid)
        connected = run.total(RECV)
        run.ctl[PHASE] = DONE
        errors = run.collect(15)
    secs = max((r.get("seconds", 0.0) for r in run.collected.values()), default=0.0)
    failures = sum(r.get("failures", 0) for r in run.collected.values())
    out: dict[str, Any] = {
        "status": "ok",
        "connections": n,
        "connected": connected,
        "failures": failures,
        "connects_per_s": round(connected / secs, 1) if secs else None,
        "rss_before_mb": round(rss0 / 2**20, 1) if rss0 else None,
        "rss_after_mb": round(rss1 / 2**20, 1) if rss1 else None,
        "rss_per_conn_kb": round((rss1 - rss0) / connected / 1024, 2)
        if rss0 and rss1 and connected
        else None,
        "cpu": CpuMeter.diff(a, b),
    }
    if out["rss_per_conn_kb"] is None:
        out["note"] = "broker pid unknown: RSS not measured"
    if errors:
        out.update(status="failed", error="; ".join(errors))
    elif connected < n:
        out.update(
            status="failed",
            error=f"only {connected}/{n} connections accepted ({failures} refused/failed)",
        )
    return out


def retained(broker: BrokerHandle, p: Params, run_id: str) -> dict[str, Any]:
    """Store N retained topics, time a ``#`` subscriber receiving them all, clear them."""
    n = p.retained_topics
    spec = _base(
        broker,
        "retained",
        f"{run_id}-ret",
        p,
        topics=[f"bench/{run_id}/ret"],
        max_msgs=n,
        inflight=100,
    )
    with Run([spec], p.setup_timeout + p.retained_limit_s + 5) as run:
        err = run.wait_ready(p.setup_timeout)
        if err:
            return _fail(f"setup: {err}")
        meter = CpuMeter(broker_pids(broker), [pr.pid for pr in run.procs if pr.pid])
        a = meter.snap()
        run.ctl[PHASE] = GO
        deadline = time.monotonic() + p.retained_limit_s
        while time.monotonic() < deadline and not run.errors() and 0 not in run.collected:
            time.sleep(0.05)
        b = meter.snap()
        stored, got = run.total(ACKED), run.total(RECV)
        run.ctl[PHASE] = DONE
        errors = run.collect(2)
        r = run.collected.get(0)
    if errors:
        return _fail("; ".join(errors))
    if r is None:
        return _fail(
            f"not finished within {p.retained_limit_s:.0f} s: {stored:,}/{n:,} retained "
            f"PUBLISHes acknowledged, {got:,} received by the wildcard subscriber",
            stored=stored,
            received=got,
            cpu=CpuMeter.diff(a, b),
        )
    out = {
        "status": "ok",
        "topics": n,
        "stored": r["acked"],
        "received": r["received"],
        "lost": max(0, r["acked"] - r["received"]),
        "publish_s": round(r["publish_s"], 3),
        "receive_all_s": round(r["receive_s"], 3),
        "retained_per_s": round(r["received"] / r["receive_s"], 1) if r["receive_s"] else None,
        "clear_s": round(r["clear_s"], 3),
        "delivered_live_not_retained": r["live_not_retained"],
        "wrong_qos": r["wrong_qos"],
        "cpu": CpuMeter.diff(a, b),
    }
    if r["live_not_retained"]:
        out["note"] = (
            f"{r['live_not_retained']:,} of {r['received']:,} arrived live (RETAIN=0): "
            "the broker acknowledged retained PUBLISHes before storing them"
        )
    if r["acked"] < n:
        out.update(status="failed", error=f"only {r['acked']}/{n} retained PUBLISHes acknowledged")
    elif r["received"] < r["acked"]:
        out.update(
            status="failed",
            error=f"subscriber got {r['received']}/{r['acked']} retained "
            "messages within the time limit",
        )
    return out


def generator_ceiling(p: Params) -> dict[str, Any]:
    """The same workers against ``benchmarks.sink``: the most any broker figure can show."""
    port_q: Any = CTX.Queue()
    stop = CTX.Event()
    run_id = uuid.uuid4().hex[:6]
    srv = CTX.Process(
        target=sink.serve,
        args=(port_q, stop, "bench/sink", p.payload, p.measure_s * 2 + 30),
        daemon=True,
    )
    srv.start()
    try:
        port = port_q.get(timeout=15)
        target = BrokerHandle("sink", port=port, pid=srv.pid)
        pub = _base(
            target, "pub", f"{run_id}-sink", p, topics=["bench/sink"], batch=32, open_loop=True
        )
        pubs = stream(target, p, [pub] * 4, [], 1, 0)
        sub = _base(target, "sub", f"{run_id}-sink", p, filters=[["bench/sink"]])
        reader = stream(target, replace(p, drain_s=0.1), [], [sub], 1, 0)
        return {
            "status": "ok",
            "publish_msgs_per_s": pubs.get("publishes_per_s"),
            "read_msgs_per_s": reader.get("deliveries_per_s"),
            "publish_cpu": pubs.get("cpu"),
            "read_cpu": reader.get("cpu"),
            "note": "4 publisher processes into a discarding sink; 1 subscriber reading a "
            "flooding sink. Sink and generator share the machine's cores.",
        }
    finally:
        stop.set()
        srv.join(5)
        if srv.is_alive():
            srv.terminate()
            srv.join(2)
