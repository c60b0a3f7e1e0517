"""Packaging (issue 13): the wheel, the Docker image's command, the compose cluster and the
systemd unit must stay in step with the code they start.

No Docker engine runs where the suite runs, so the image itself is not built here; what can
drift silently is checked instead: every command line these files give is parsed by the
real ``mqttring`` parser and turned into a config by the real validation, and the wheel
built from the same files the Dockerfile copies carries the package data and the entry point.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from mqttring.cli import build_parser
from mqttring.config import parse_hostport
from mqttring.node import config_from_args

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(180)


def _dockerfile_instruction(name: str) -> list[str]:
    """The JSON (exec form) argument of the final stage's ``name`` instruction."""
    text = (ROOT / "Dockerfile").read_text()
    found = re.findall(rf"^{name}\s+(\[.*\])\s*$", text, flags=re.MULTILINE)
    assert found, f"Dockerfile has no exec-form {name}"
    return json.loads(found[-1])


def _node_config(argv: list[str], monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MQTTRING_CLUSTER_SECRET", "packaging-test-secret")
    args = build_parser().parse_args(argv)
    assert args.command == "node", argv
    return config_from_args(args)


def test_docker_image_command_is_a_valid_node_command(monkeypatch):
    """ENTRYPOINT + CMD is what `docker run mqttring` executes."""
    argv = _dockerfile_instruction("ENTRYPOINT") + _dockerfile_instruction("CMD")
    assert argv[0] == "mqttring", "the image runs the console script"
    config = _node_config(argv[1:], monkeypatch)
    assert config.mqtt is not None
    host, port = parse_hostport(config.mqtt)
    assert host == "0.0.0.0", "inside a container the broker must listen beyond loopback"
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(rf"^EXPOSE .*\b{port}\b", text, flags=re.MULTILINE)
    assert str(config.data_dir) in text.split("VOLUME", 1)[1], "data must be on the volume"
    assert re.search(r"^USER (?!root)\w+", text, flags=re.MULTILINE), "image runs as non-root"


def test_compose_cluster_commands_form_one_cluster(monkeypatch):
    compose = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    services = compose["services"]
    assert len(services) == 3
    clusters: dict[str, str] = {}
    joins: dict[str, str | None] = {}
    host_ports: set[str] = set()
    node_ids: set[str] = set()
    for name, service in services.items():
        config = _node_config(["node", *service["command"]], monkeypatch)
        assert config.cluster is not None and config.cluster_secret
        cluster_host, _ = parse_hostport(config.cluster)
        assert cluster_host == name, "a node advertises its service name to its peers"
        clusters[name] = config.cluster
        joins[name] = config.join
        node_ids.add(config.node_id)
        assert config.mqtt is not None
        _, mqtt_port = parse_hostport(config.mqtt)
        published = [p.split(":") for p in service["ports"]]
        assert [host for host, inside in published if int(inside) == mqtt_port]
        host_ports.update(host for host, _ in published)
        volume = service["volumes"][0].split(":")[1]
        assert Path(volume) == config.data_dir
    assert len(node_ids) == 3 and len(host_ports) == 3
    founders = [name for name, join in joins.items() if join is None]
    assert len(founders) == 1, "exactly one node forms the cluster, the others join it"
    for name, join in joins.items():
        if join is not None:
            assert join == clusters[founders[0]], f"{name} joins an address nobody has"


def test_systemd_unit_command_parses():
    unit = (ROOT / "deploy" / "mqttring.service").read_text()
    exec_start = re.search(r"^ExecStart=(.*)$", unit, flags=re.MULTILINE)
    assert exec_start is not None
    argv = shlex.split(exec_start.group(1))
    assert Path(argv[0]).name == "mqttring"
    args = build_parser().parse_args(argv[1:])
    assert args.command == "node" and args.config is not None
    assert "RestartPreventExitStatus=2" in unit, "a config error (exit 2) must not loop"
    stop = int(re.search(r"^TimeoutStopSec=(\d+)", unit, flags=re.MULTILINE).group(1))
    from mqttring.broker.server import LEAVE_SLACK
    from mqttring.config import BrokerConfig

    assert stop >= BrokerConfig().leave_timeout + LEAVE_SLACK, "systemd would kill a leave"


def test_wheel_from_the_docker_build_context(tmp_path):
    """The Dockerfile builds a wheel from pyproject.toml, setup.cfg, README.md and src/."""
    context = tmp_path / "context"
    context.mkdir()
    copied = re.findall(r"^COPY (?!--from)(.+) \S+$", (ROOT / "Dockerfile").read_text(),
                        flags=re.MULTILINE)
    for line in copied:
        for name in line.split():
            source = ROOT / name
            target = context / name
            if source.is_dir():
                subprocess.run(["cp", "-r", str(source), str(target)], check=True)
            else:
                target.write_bytes(source.read_bytes())
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
         "--wheel-dir", str(wheels), str(context)],
        check=True, timeout=150,
    )
    (wheel,) = wheels.glob("mqttring-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = next(n for n in names if n.endswith("entry_points.txt"))
        assert "mqttring = mqttring.cli:main" in archive.read(entry_points).decode()
    assert "mqttring/py.typed" in names
    assert "mqttring/node.py" in names and "mqttring/raft/service.py" in names
    static = ROOT / "src" / "mqttring" / "http" / "static"
    shipped = {str(p.relative_to(ROOT / "src")) for p in static.rglob("*") if p.is_file()}
    assert shipped and shipped <= names, f"dashboard files missing: {shipped - names}"
