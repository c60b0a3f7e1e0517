"""The embedding API's failures, as an application sees them (``docs/embedding.md``).

Each failure is one plain, typed exception that names what went wrong, and leaves nothing
running behind it: a ``start()`` that times out cancels the half-started node and waits for
its thread (its ports, its store and its flusher thread are released), ``stop()`` stops a
node that is still starting, an exception raised inside ``async with MqttRingBroker(...)``
comes out as itself (not wrapped in trio's ``ExceptionGroup``), and a bad ``data_dir`` or
a config of the wrong type is a ``ConfigError`` or ``TypeError`` of one line.  Real nodes,
real sockets: the join address is a bound port nobody listens on.
"""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from mqttring import BrokerConfig, ConfigError, MqttRingBroker

pytestmark = pytest.mark.timeout(120)

HOST = "127.0.0.1"
#: Threads a node runs beside the caller's (trio's idle worker-thread cache aside).
NODE_THREADS = {"mqttring-broker", "lsm-flusher"}


def node_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name in NODE_THREADS}


def wait_for(probe: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := probe()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
    return value


@pytest.fixture
def dead_address() -> Iterator[str]:
    """HOST:PORT of a bound socket that never listens: a connection there is refused."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        yield f"{HOST}:{sock.getsockname()[1]}"


@pytest.fixture
def joining(tmp_path: Path, dead_address: str) -> BrokerConfig:
    """A cluster member whose ``join`` address nobody answers: it never gets ready."""
    assert not node_threads(), f"a node of an earlier test still runs: {node_threads()}"
    return BrokerConfig(node_id="lonely", mqtt=f"{HOST}:0", cluster=f"{HOST}:0",
                        raft=f"{HOST}:0", join=dead_address, cluster_secret="s3cret-s3cret",
                        data_dir=tmp_path / "lonely", sys_interval=0)


def test_a_start_that_times_out_cancels_the_node_and_names_what_it_waited_for(
        joining: BrokerConfig, dead_address: str) -> None:
    broker = MqttRingBroker(joining)
    began = time.monotonic()
    with pytest.raises(TimeoutError) as caught:
        broker.start(timeout=2)
    took = time.monotonic() - began
    message = str(caught.value)
    assert "within 2 s" in message and f"joining the cluster through {dead_address}" in message
    assert 2 <= took < 2 + broker.halt_grace, took
    assert not node_threads()  # ended before start() raised, store closed
    began = time.monotonic()
    broker.stop(timeout=5)  # nothing left to stop
    assert time.monotonic() - began < 1
    # Its store was closed: another node opens the same data directory.
    alone = MqttRingBroker(BrokerConfig(node_id="alone", mqtt=f"{HOST}:0",
                                        data_dir=joining.data_dir, sys_interval=0))
    assert alone.start(timeout=30).mqtt
    alone.stop(timeout=30)
    assert not node_threads()


def test_stop_ends_a_node_that_is_still_starting(joining: BrokerConfig) -> None:
    broker = MqttRingBroker(joining)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        starting = pool.submit(broker.start, 60)
        wait_for(lambda: broker.plane is not None, 30, "the member to be joining")
        began = time.monotonic()
        broker.stop(timeout=5)
        assert time.monotonic() - began < 5
        assert not node_threads()
        with pytest.raises(RuntimeError, match=r"stopped .* before it started listening"):
            starting.result(timeout=5)


async def test_an_exception_in_the_body_comes_out_as_itself(tmp_path: Path) -> None:
    config = BrokerConfig(node_id="body", mqtt=f"{HOST}:0", data_dir=None, sys_interval=0)
    with pytest.raises(KeyError, match="app error"):
        async with MqttRingBroker(config):
            raise KeyError("app error")
    mine = ExceptionGroup("the application's own", [ValueError("one"), OSError("two")])
    with pytest.raises(ExceptionGroup) as caught:
        async with MqttRingBroker(config):
            raise mine
    assert caught.value is mine
    # Cancelled from outside: a clean stop, nothing raised.
    with trio.move_on_after(0.2) as scope:
        async with MqttRingBroker(config) as broker:
            await trio.sleep_forever()
    assert scope.cancelled_caught and broker.store is None


@pytest.mark.parametrize("how", ["a file", "under a file"])
@pytest.mark.parametrize("api", ["start", "async with"])
def test_an_unusable_data_dir_is_a_config_error_naming_it(tmp_path: Path, how: str,
                                                          api: str) -> None:
    afile = tmp_path / "not-a-dir"
    afile.write_text("x")
    data_dir = afile if how == "a file" else afile / "data"
    broker = MqttRingBroker(BrokerConfig(node_id="d", mqtt=f"{HOST}:0", data_dir=data_dir,
                                         sys_interval=0))
    with pytest.raises(ConfigError) as caught:
        if api == "start":
            broker.start(timeout=30)
        else:

            async def enter() -> None:
                async with broker:
                    pass

            trio.run(enter)
    assert str(caught.value).startswith(f'data_dir = "{data_dir}": ')
    assert "not a directory" in str(caught.value) and "\n" not in str(caught.value)
    assert not node_threads()


def test_a_config_of_the_wrong_type_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"must be a mqttring\.BrokerConfig, not dict"):
        MqttRingBroker({"mqtt": f"{HOST}:0"})  # type: ignore[arg-type]


def test_a_store_that_cannot_be_opened_is_a_store_error_naming_it(tmp_path: Path) -> None:
    """In use by another broker of this process, or not an LMDB file: ``mqttring.StoreError``
    (documented in docs/embedding.md), one line naming the path, nothing left running."""
    from mqttring import StoreError

    first = MqttRingBroker(BrokerConfig(node_id="one", mqtt=f"{HOST}:0",
                                        data_dir=tmp_path / "shared", sys_interval=0))
    first.start(timeout=30)
    try:
        second = MqttRingBroker(BrokerConfig(node_id="two", mqtt=f"{HOST}:0",
                                             data_dir=tmp_path / "shared", sys_interval=0))
        with pytest.raises(StoreError, match="in use by") as caught:
            second.start(timeout=30)
        assert str(tmp_path / "shared" / "store") in str(caught.value)
    finally:
        first.stop()
    (tmp_path / "bad" / "store").mkdir(parents=True)
    (tmp_path / "bad" / "store" / "data.mdb").write_bytes(b"\x5a" * 65536)
    broken = MqttRingBroker(BrokerConfig(node_id="b", mqtt=f"{HOST}:0",
                                         data_dir=tmp_path / "bad", sys_interval=0))
    with pytest.raises(StoreError, match="not an LMDB file") as caught:
        broken.start(timeout=30)
    assert "\n" not in str(caught.value)
    assert not node_threads()
