"""A retained query is answered by the view it was asked by, or a newer one (no processes).

The asker chose the answering node by its own view; an answer made under an older view
covers the shards the node owned before, and leaves out those it has just taken over
(a probe: a node killed, a subscriber through the Raft leader got 28 of 30 retained
messages).  The end-to-end case: ``test_cluster_faults.py``, wildcard subscribe after a kill.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import trio

from mqttring.cluster.messages import RetainedQuery, RetainedRows
from mqttring.cluster.retained_query import RetainedQueries
from mqttring.cluster.viewchanges import ViewChanges
from mqttring.protocol.message import Message

SHARD_OF = {"r/1": 0, "r/2": 1}


@dataclass
class View:
    epoch: int
    owners: dict[int, str]

    def owner(self, shard: int) -> str:
        return self.owners[shard]


class Retained:
    def matching(self, topic_filter: str, owned: Any) -> list[Message]:
        return [Message(t, b"v", 1, True) for t, s in SHARD_OF.items() if owned(s)]


class Links:
    max_frame = 1 << 20

    def __init__(self) -> None:
        self.replies: list[tuple[int, RetainedRows]] = []

    def reply(self, node: str, req: int, ok: bool, body: RetainedRows) -> None:
        self.replies.append((req, body))


def test_an_owner_whose_view_is_behind_the_askers_answers_once_it_caught_up() -> None:
    links, changes = Links(), ViewChanges()
    view = View(1, {0: "me", 1: "dead"})  # ours, before the dead owner's shard came to us
    queries = RetainedQueries("me", None, Retained(), links, lambda: view,  # type: ignore[arg-type]
                              None, changes, patience=5.0)  # type: ignore[arg-type]

    async def main() -> None:
        nonlocal view
        async with trio.open_nursery() as nursery:
            nursery.start_soon(queries.on_query, "asker", RetainedQuery(7, "r/#", "", 2))
            await trio.sleep(0.1)
            assert links.replies == [], "answered by an older view than the asker's"
            view = View(2, {0: "me", 1: "me"})
            changes.notify()

    trio.run(main)
    [(req, rows)] = links.replies
    assert req == 7 and rows.epoch == 2
    assert sorted(r.topic for r in rows.rows) == ["r/1", "r/2"]


def test_an_asker_behind_the_owner_gets_the_owners_epoch_to_ask_again_by() -> None:
    links, changes = Links(), ViewChanges()
    view = View(3, {0: "me", 1: "other"})
    queries = RetainedQueries("me", None, Retained(), links, lambda: view,  # type: ignore[arg-type]
                              None, changes, patience=5.0)  # type: ignore[arg-type]
    trio.run(queries.on_query, "asker", RetainedQuery(8, "r/#", "", 2))
    [(req, rows)] = links.replies
    assert req == 8 and rows.epoch == 3  # newer than the asker's: it asks again by view 3
    assert [r.topic for r in rows.rows] == ["r/1"]
