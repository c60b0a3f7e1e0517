"""Cluster scenarios: publishers on one node of a local 3-node cluster, subscribers on others.

What it would measure (issue 7): inter-node messages per publish, read from the nodes'
own counters (issue 5: "publishes received from clients, forwarded to owners, delivery
messages sent to other nodes, deliveries to local clients"), and total CPU seconds per
delivered message against a single node.

What it does today: check that the pieces it needs exist, and if any is missing, report
"not available" with the exact reason.  It never estimates: a figure here must come from a
real cluster's counters.  The contract it probes for (documented in docs/benchmarks.md):

* ``python -m mqttring.devcluster`` (``make cluster``) to start N local nodes, and
* ``python -m mqttring.node`` options to join a cluster (``--join``/``--peers``/``--cluster``),
* per-node counters published under ``$SYS/broker/cluster/``.

Mosquitto and amqtt have no clustering, so for them the scenario is "not available" too.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from typing import Any

from benchmarks.brokers import BrokerHandle
from benchmarks.scenarios import Params

CLUSTER_FLAGS = ("--join", "--peers", "--cluster")


def cluster_support(broker: BrokerHandle) -> str | None:
    """None if a local cluster can be measured; otherwise why not."""
    if broker.name != "mqttring":
        return f"{broker.name} has no clustering"
    if importlib.util.find_spec("mqttring.node") is None:
        return "mqttring.node does not exist yet"
    if importlib.util.find_spec("mqttring.devcluster") is None:
        return (
            "no mqttring.devcluster to start a local 3-node cluster (issue 5, "
            "`make cluster`) - cluster data plane not implemented yet"
        )
    try:
        out = subprocess.run(
            [sys.executable, "-m", "mqttring.node", "--help"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (subprocess.SubprocessError, OSError) as exc:
        return f"`python -m mqttring.node --help` failed: {exc}"
    if not any(flag in out.stdout for flag in CLUSTER_FLAGS):
        return f"mqttring.node has none of {', '.join(CLUSTER_FLAGS)}: no cluster data plane"
    return (
        "cluster entry points exist but the inter-node counters contract "
        "($SYS/broker/cluster/...) is not wired into this harness yet"
    )


def run(broker: BrokerHandle, p: Params, run_id: str) -> dict[str, Any]:
    reason = cluster_support(broker)
    if reason:
        return {"status": "not available", "reason": reason}
    return {"status": "not available", "reason": "unreachable"}  # pragma: no cover
