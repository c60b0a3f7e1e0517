"""``mqttring.config``: one schema for the file, the environment, flags and Python.

Each refused value is one the broker used to accept (and then misbehave on, or crash on with
a traceback); each error must be one line naming the key, the value and what is allowed.  The
last tests run ``python -m mqttring.node`` for real: a bad setting exits 2 with one line on
stderr before any port is bound or the data directory is created.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
import typing
from pathlib import Path
from typing import Annotated, Literal

import pytest
from msgspec import Meta

from mqttring.config import (
    BrokerConfig,
    ConfigError,
    Limits,
    StoreSettings,
    environment_overrides,
    flag_overrides,
)
from mqttring.config_fields import check_fields, field_specs, parse_text

pytestmark = pytest.mark.timeout(60)



@pytest.fixture(autouse=True)
def _no_secret_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cluster-secret rule falls back to ``$MQTTRING_CLUSTER_SECRET``: keep it out."""
    monkeypatch.delenv("MQTTRING_CLUSTER_SECRET", raising=False)


def load(tmp_path: Path, text: str, **kw: object) -> BrokerConfig:
    path = tmp_path / "node.toml"
    path.write_text(text)
    return BrokerConfig.from_toml(path, environ={}, **kw)


def refused(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, text)
    message = str(info.value)
    assert "\n" not in message, f"not one line: {message!r}"
    return message


@pytest.mark.parametrize(("toml", "message"), [
    # wrong types, refused instead of crashing later
    ('[limits]\nmax_inflight = "32"',
     'limits.max_inflight = "32": expected an integer in 1..65535'),
    ("ws = 8080", 'ws = 8080: expected HOST:PORT with a port in 0..65535, or "" / false'),
    ("data_dir = 5", "data_dir = 5: expected a path"),
    ('sys_interval = "10"', 'sys_interval = "10": expected a finite number >= 0'),
    ("[limits]\nmax_inflight = true", "limits.max_inflight = true: expected an integer"),
    # wrong values
    ('allow_anonymous = "no"', 'allow_anonymous = "no": expected true or false'),
    ('[users]\nalice = "secret"', "users: the [users] table (unsalted SHA-256) was removed: "
                                   "put each user in a password file with `mqttring passwd"),
    ('password_file = 5', "password_file = 5: expected a path"),
    ("auth_failures_allowed = -1", "auth_failures_allowed = -1: expected an integer >= 0"),
    ("[limits]\nqueued_message_ttl = -5",
     "limits.queued_message_ttl = -5: expected a finite number >= 0"),
    ("[limits]\nmax_outgoing_buffer = -1",
     "limits.max_outgoing_buffer = -1: expected an integer >= 1"),
    ("[limits]\nmax_client_id_bytes = 500",
     "limits.max_client_id_bytes = 500: expected an integer in 23..499"),
    ("[store]\nlazy_sync_ms = -1", "store.lazy_sync_ms = -1: expected an integer >= 0"),
    ("[store]\nmap_size = 0", "store.map_size = 0: expected an integer >= 65536"),
    ('archive = ["sensors/#/x"]',
     'archive = ["sensors/#/x"]: expected MQTT topic filters: [MQTT-4.7.1-2]'),
    ("cluster_secret = 5", "cluster_secret = (hidden): expected a string"),
    ("limits = 5", "limits = 5: expected a table ([limits])"),
    # unknown keys, top level and in tables, with the nearest known key
    ("[limits]\nmax_inflite = 5",
     "limits.max_inflite = 5: unknown setting (did you mean limits.max_inflight?)"),
    ('nodeid = "x"', 'nodeid = "x": unknown setting (did you mean node_id?)'),
    # rules over several fields keep naming every field involved
    ("mqtt = false", "mqtt and ws are both off: at least one listener is needed"),
    ("heartbeat_interval = 2.0\nfailure_grace = 1.0",
     "failure_grace = 1.0: must exceed heartbeat_interval = 2.0"),
    ('cluster = "127.0.0.1:7000"',
     'cluster = "127.0.0.1:7000": needs cluster_secret (or $MQTTRING_CLUSTER_SECRET)'),
    ("mqtt = null", "not valid TOML: Invalid value (at line 1, column 8); TOML has no null"),
    # joining a cluster needs this node's own cluster address: without it, a lone broker
    ('join = "127.0.0.1:7001"', 'join = "127.0.0.1:7001": needs cluster = HOST:PORT'),
    ('raft = "127.0.0.1:7002"', 'raft = "127.0.0.1:7002": needs cluster = HOST:PORT'),
])
def test_bad_file_values_are_refused_in_one_line(tmp_path: Path, toml: str, message: str):
    assert message in refused(tmp_path, toml)


def test_documented_values_load(tmp_path: Path):
    config = load(tmp_path, 'archive = ["sensors/#", "+/alarm"]\nsys_interval = 0\n'
                            'password_file = "pw"\n[limits]\nconnect_timeout = 3\n')
    assert config.archive == ("sensors/#", "+/alarm")
    assert config.password_file == Path("pw")
    assert config.limits.connect_timeout == 3.0 and config.sys_interval == 0.0


@pytest.mark.parametrize("off", ['""', "false"])
def test_a_listener_is_turned_off_with_empty_string_or_false(tmp_path: Path, off: str):
    config = load(tmp_path, f'mqtt = {off}\nws = "127.0.0.1:0"\n')
    assert config.mqtt is None and config.ws == "127.0.0.1:0"
    assert load(tmp_path, f"ws = {off}\n").ws is None


def test_python_construction_is_checked_and_normalised():
    """Embedded use: the same rules, a str accepted for a path, ``replace`` checked too."""
    config = BrokerConfig(data_dir="data", archive=["a/#"])  # type: ignore[arg-type]
    assert config.data_dir == Path("data") and config.archive == ("a/#",)
    for bad, key in [({"sys_interval": "10"}, "sys_interval"),
                     ({"allow_anonymous": "no"}, "allow_anonymous"),
                     ({"mqtt": 1883}, "mqtt"),
                     ({"data_dir": 5}, "data_dir"),
                     ({"acl_file": 5}, "acl_file")]:
        with pytest.raises(ConfigError, match=rf"^{key} = "):
            BrokerConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^limits.max_inflight = 0: expected an integer"):
        Limits(max_inflight=0)
    with pytest.raises(ConfigError, match=r"^store.memtable_max_bytes = "):
        StoreSettings(memtable_max_bytes="1")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^replication = 0: "):
        dataclasses.replace(config, replication=0)
    with pytest.raises(ConfigError, match=r"^link_replay_window = 0: "):
        dataclasses.replace(config, link_replay_window=0)
    with pytest.raises(ConfigError, match=r"^link_stall_timeout = 0"):
        dataclasses.replace(config, link_stall_timeout=0)
    with pytest.raises(ConfigError, match=r"^link_ack_interval = 1.0: must be at most "
                                          r"link_stall_timeout / 4"):
        dataclasses.replace(config, link_ack_interval=1.0)
    nested = BrokerConfig(limits={"max_inflight": 5})  # type: ignore[arg-type]
    assert nested.limits == Limits(max_inflight=5)


def test_a_new_setting_is_one_annotated_line():
    """The contract other branches rely on: type and range in the annotation, nothing else."""
    @dataclasses.dataclass(frozen=True, slots=True)
    class Settings:
        log_level: Literal["debug", "info"] = "info"
        log_file: Path | None = None
        http_workers: Annotated[int, Meta(ge=1, le=64)] = 4

        def __post_init__(self) -> None:
            check_fields(self)

    assert Settings(log_file="x.log").log_file == Path("x.log")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r'^log_level = "loud": expected one of "debug", '):
        Settings(log_level="loud")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^--http-workers = \"0\": expected an integer in 1..64"):
        parse_text(field_specs(Settings)["http_workers"], "0", "--http-workers")


def test_precedence_defaults_file_environment_flags(tmp_path: Path):
    text = 'node_id = "from-file"\nsys_interval = 3\n[limits]\nmax_inflight = 7\nmax_queued = 9\n'
    environ = {"MQTTRING_SYS_INTERVAL": "4", "MQTTRING_LIMITS__MAX_INFLIGHT": "8",
               "MQTTRING_WS": "127.0.0.1:0", "MQTTRING_ALLOW_ANONYMOUS": "false",
               "MQTTRING_ARCHIVE": '["a/#"]', "PATH": "/bin"}
    flags = flag_overrides({"sys_interval": "5", "node_id": None, "mqtt": ""})
    path = tmp_path / "node.toml"
    path.write_text(text)
    config = BrokerConfig.from_toml(path, environ=environ, **flags)
    assert config.node_id == "from-file"  # file over default
    assert config.limits.max_queued == 9  # file, kept when env sets a sibling key
    assert config.limits.max_inflight == 8  # env over file
    assert config.sys_interval == 5.0  # flag over env over file
    assert config.mqtt is None and config.ws == "127.0.0.1:0"  # flag '' turns mqtt off
    assert config.allow_anonymous is False and config.archive == ("a/#",)
    assert config.limits.max_packet_size == Limits().max_packet_size  # default


@pytest.mark.parametrize(("environ", "message"), [
    ({"MQTTRING_LIMITS__MAX_INFLIGHT": "x"},
     'MQTTRING_LIMITS__MAX_INFLIGHT = "x": expected an integer in 1..65535'),
    ({"MQTTRING_ALLOW_ANONYMOUS": "no"}, 'MQTTRING_ALLOW_ANONYMOUS = "no": expected true or'),
    ({"MQTTRING_MQTT": "nowhere"}, 'MQTTRING_MQTT = "nowhere": expected HOST:PORT'),
    ({"MQTTRING_ARCHIVE": "a/#"}, 'MQTTRING_ARCHIVE = "a/#": expected a list of MQTT topic'),
    ({"MQTTRING_MAX_INFLIGHT": "5"},
     "MQTTRING_MAX_INFLIGHT: no such setting (did you mean MQTTRING_LIMITS__MAX_INFLIGHT?)"),
    ({"MQTTRING_LIMITS": "{}"}, "MQTTRING_LIMITS: [limits] is a table: set its keys one by one, "
                                "as MQTTRING_LIMITS__<KEY>"),
    ({"MQTTRING_CLUSTER_SECRET": ""}, ""),  # empty: no secret, not an error by itself
])
def test_environment_errors_name_the_variable(environ: dict[str, str], message: str):
    if not message:
        assert environment_overrides(environ) == {"cluster_secret": ""}
        return
    with pytest.raises(ConfigError) as info:
        BrokerConfig.from_mapping({}, environ=environ)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_docs_list_every_setting_with_what_it_allows():
    """docs/configuration.md's table is the schema's: a new field needs its row there."""
    rows = []
    for name, spec in field_specs(BrokerConfig).items():
        subs = field_specs(spec.table).items() if spec.table else [("", spec)]
        for sub, leaf in subs:
            key, var = (f"{name}.{sub}", f"{name}__{sub}") if sub else (name, name)
            rows.append(f"| `{key}` | `MQTTRING_{var.upper()}` | {leaf.allowed} |")
    doc = (Path(__file__).parents[1] / "docs" / "configuration.md").read_text()
    section = doc.split("## Allowed values and environment variables", 1)[1].split("\n## ")[0]
    documented = [line for line in section.splitlines() if line.startswith("| `")]
    missing = [row for row in rows if row not in documented]
    stale = [row for row in documented if row not in rows]
    assert not missing and not stale, f"add to docs/configuration.md: {missing}; " \
                                      f"remove: {stale}"


def parse_node_args(*argv: str) -> argparse.Namespace:
    from mqttring.node import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_flags_go_through_the_same_checks(monkeypatch: pytest.MonkeyPatch):
    from mqttring.node import config_from_args

    for name in [n for n in os.environ if n.startswith("MQTTRING_")]:
        monkeypatch.delenv(name)
    config = config_from_args(parse_node_args("--mqtt", "", "--ws", "127.0.0.1:0",
                                              "--data-dir", "d", "--replication", "3"))
    assert (config.mqtt, config.ws, config.data_dir, config.replication) == (
        None, "127.0.0.1:0", Path("d"), 3)
    for argv, message in [(["--replication", "0"], '--replication = "0": expected an integer'),
                          (["--sys-interval", "soon"], '--sys-interval = "soon": expected a'),
                          (["--mqtt", "1883"], '--mqtt = "1883": expected HOST:PORT')]:
        with pytest.raises(ConfigError) as info:
            config_from_args(parse_node_args(*argv))
        assert message in str(info.value)


def _float_settings() -> list[tuple[str, str]]:
    """Every number (float) setting as (TOML table or "", key): durations, intervals."""
    found = []
    for table, cls in (("", BrokerConfig), ("limits", Limits), ("store", StoreSettings)):
        for name, spec in field_specs(cls).items():
            base = spec.type
            if typing.get_origin(base) is Annotated:
                base = typing.get_args(base)[0]
            if base is float:
                found.append((table, name))
    return found


FLOAT_SETTINGS = _float_settings()


def test_there_are_float_settings_to_check():
    """The parametrisations below are over ``FLOAT_SETTINGS``: never an empty list."""
    assert ("", "sys_interval") in FLOAT_SETTINGS
    assert ("limits", "connect_timeout") in FLOAT_SETTINGS
    assert ("", "heartbeat_interval") in FLOAT_SETTINGS


@pytest.mark.parametrize(("table", "key"), FLOAT_SETTINGS,
                         ids=[f"{t}.{k}" if t else k for t, k in FLOAT_SETTINGS])
@pytest.mark.parametrize("number", ["inf", "-inf", "nan", "+inf"])
def test_no_duration_or_limit_is_infinite_or_nan(tmp_path: Path, table: str, key: str,
                                                 number: str):
    """TOML, the environment and flags all read ``inf`` as a float, and every lower bound
    let it through: ``sys_interval = inf`` or ``limits.connect_timeout = inf`` loaded (nan
    was refused only by the range check).  Refused now in every layer, in one line."""
    label = f"{table}.{key}" if table else key
    toml = f"[{table}]\n{key} = {number}\n" if table else f"{key} = {number}\n"
    shown = number.lstrip("+")
    assert f"{label} = {shown}: expected a finite number" in refused(tmp_path, toml)
    var = f"MQTTRING_{table.upper()}__{key.upper()}" if table else f"MQTTRING_{key.upper()}"
    with pytest.raises(ConfigError) as info:
        BrokerConfig.from_mapping({}, environ={var: number})
    assert f'{var} = "{number}": expected a finite number' in str(info.value)
    value = float(number)
    with pytest.raises(ConfigError) as info:
        if table:
            dataclasses.replace(Limits() if table == "limits" else StoreSettings(),
                                **{key: value})
        else:
            BrokerConfig(**{key: value})
    assert f"{label} = {shown}: expected a finite number" in str(info.value)


@pytest.mark.parametrize("number", ["inf", "nan", "1e999"])
def test_an_infinite_duration_flag_is_refused(number: str):
    """``1e999`` is inf too, once a float."""
    from mqttring.node import config_from_args

    with pytest.raises(ConfigError) as info:
        config_from_args(parse_node_args("--sys-interval", number))
    assert f'--sys-interval = "{number}": expected a finite number >= 0' in str(info.value)


# --------------------------------------------------------------------------- real processes


def node_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MQTTRING_")}
    return {**env, **extra}


def run_node(tmp_path: Path, *argv: str, env: dict[str, str] | None = None
             ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mqttring.node", *argv], cwd=tmp_path,
                          env=env or node_env(), capture_output=True, text=True, timeout=60)


def held_port() -> socket.socket:
    """A listening socket: a node that tried to bind its port would fail with exit 1."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


@pytest.mark.parametrize(("toml", "flags", "env", "line"), [
    ('[limits]\nmax_inflight = "32"\n', [], {},
     'mqttring: configuration error: limits.max_inflight = "32": expected an integer in '
     "1..65535"),
    ("", ["--cluster", "127.0.0.1:{port}"], {},
     'mqttring: configuration error: cluster = "127.0.0.1:{port}": needs cluster_secret'),
    ("", [], {"MQTTRING_LIMITS__MAX_INFLIGHT": "x"},
     'mqttring: configuration error: MQTTRING_LIMITS__MAX_INFLIGHT = "x": expected'),
    # non-finite durations, from each layer
    ("[limits]\nconnect_timeout = inf\n", [], {},
     "mqttring: configuration error: limits.connect_timeout = inf: expected a finite number "
     "> 0"),
    ("", ["--sys-interval", "inf"], {},
     'mqttring: configuration error: --sys-interval = "inf": expected a finite number >= 0'),
    ("", [], {"MQTTRING_HEARTBEAT_INTERVAL": "inf"},
     'mqttring: configuration error: MQTTRING_HEARTBEAT_INTERVAL = "inf": expected a finite '
     "number > 0"),
])
def test_node_with_bad_setting_exits_2_with_one_line_before_starting(
        tmp_path: Path, toml: str, flags: list[str], env: dict[str, str], line: str):
    with held_port() as mqtt, held_port() as cluster:
        port = cluster.getsockname()[1]
        (tmp_path / "bad.toml").write_text(toml)
        data_dir = tmp_path / "data"
        done = run_node(tmp_path, "--config", "bad.toml", "--data-dir", str(data_dir),
                        "--mqtt", f"127.0.0.1:{mqtt.getsockname()[1]}",
                        "--ready-file", "ready.json",
                        *[f.format(port=port) for f in flags], env=node_env(**env))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(line.format(port=port)), done.stderr
    assert not data_dir.exists() and not (tmp_path / "ready.json").exists()


def test_websocket_only_node_from_a_file(tmp_path: Path):
    """``mqtt = false`` (once inexpressible: ``null`` is not TOML) runs a WebSocket-only node."""
    (tmp_path / "ws.toml").write_text(
        f'mqtt = false\nws = "127.0.0.1:0"\ndata_dir = "{tmp_path / "data"}"\n')
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen([sys.executable, "-m", "mqttring.node", "--config", "ws.toml",
                             "--ready-file", str(ready)], cwd=tmp_path, env=node_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "node not ready in 30s"
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        assert info["mqtt"] is None and info["ws"]
        with socket.create_connection(("127.0.0.1", info["ws"]), timeout=5) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                         b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                         b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: mqtt\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 101")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("command", [["status", "--node", "127.0.0.1:1"],
                                     ["leave", "--node", "127.0.0.1:1"],
                                     ["snapshot", "--node", "127.0.0.1:1", "--out", "x"]],
                         ids=["status", "leave", "snapshot"])
@pytest.mark.parametrize("timeout", ["nan", "-1", "0", "inf", "soon"])
def test_a_command_timeout_is_a_finite_positive_number(tmp_path: Path, command: list[str],
                                                       timeout: str):
    """``--timeout`` was ``type=float``: ``nan`` and ``-1`` were a ValueError traceback from
    trio inside the call, ``inf`` a command that waited for ever on a silent node.  Refused
    now by the parser (exit 2, its usage and one error line), before any connection."""
    done = subprocess.run([sys.executable, "-m", "mqttring", *command, "--secret", "s",
                           "--timeout", timeout], cwd=tmp_path, env=node_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1].endswith(
        f"error: argument --timeout: {timeout!r}: expected a finite number of seconds > 0")
