"""Pages of the HTTP API's client and subscription listings (``broker/inspect.py``): the
heap-based paging gives exactly what sorting every row and slicing gave, page after page."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from mqttring.broker.inspect import list_subscriptions

ids = st.text(alphabet="abc", min_size=0, max_size=3)
filters = st.dictionaries(st.text(alphabet="xy/#", min_size=1, max_size=3),
                          st.integers(0, 2), max_size=4)


def _core(sessions: dict[str, dict[str, int]]) -> Any:
    made = {cid: SimpleNamespace(client_id=cid, subscriptions=dict(subs))
            for cid, subs in random.sample(sorted(sessions.items()), len(sessions))}
    return SimpleNamespace(sessions=made)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(ids, filters, max_size=12), st.integers(1, 5))
def test_paging_through_subscriptions_yields_every_row_once_in_order(sessions, limit):
    core = _core(sessions)
    everything = sorted((cid, f, q) for cid, subs in sessions.items() for f, q in subs.items())
    seen: list[tuple[str, str, int]] = []
    after = ("", "")
    for _ in range(len(everything) + 2):
        page = list_subscriptions(core, "n", after=after, limit=limit)
        assert len(page) <= limit
        if not page:
            break
        seen.extend((r["client_id"], r["filter"], r["qos"]) for r in page)
        after = (page[-1]["client_id"], page[-1]["filter"])
    # The empty client id sorts first and is reached only by the first page's cursor
    # ("", ""): rows equal to the cursor are never repeated, as before.
    assert seen == [row for row in everything if row[:2] > ("", "")]
    for cid in sessions:
        mine = list_subscriptions(core, "n", client=cid, limit=100)
        assert [(r["filter"], r["qos"]) for r in mine] == sorted(sessions[cid].items())
