"""The checker's rules on hand-made histories (no namespaces, no root): what counts as lost,
duplicate, reordered and owed, so that a fault-suite failure is the broker's, not ours."""

from __future__ import annotations

from .checker import (
    SubscriberRecord,
    check_delivery,
    check_dual,
    check_retained,
    max_gap,
    verdict,
)
from .workload import Acked, Delivery


def acked(seq: int, t: float, conn: int = 1) -> Acked:
    return Acked("p", conn, seq, "t", t, t + 0.01)


def got(seq: int, t: float, conn: int = 1) -> Delivery:
    return Delivery(t, "t", "p", conn, seq, False, False)


def test_persistent_is_owed_everything_sent_after_its_suback() -> None:
    history = [acked(1, 1.0), acked(2, 2.0), acked(3, 3.0)]
    sub = SubscriberRecord("ps", False, [got(2, 2.1)], first_suback=1.5, intervals=[])
    result = check_delivery([sub], history)
    assert result["lost_persistent"] == 1  # seq 3; seq 1 predates the SUBACK
    assert result["samples"][0]["seq"] == 3


def test_clean_is_owed_only_what_its_connection_covered() -> None:
    history = [acked(1, 1.0), acked(2, 10.0), acked(3, 20.0)]
    # connected 0.5..12 (broken), then 15.. until we closed it at the end
    sub = SubscriberRecord("cs", True, [], first_suback=0.5,
                           intervals=[[0.5, 12.0, None], [15.0, 30.0, 1.0]])
    result = check_delivery([sub], history)
    # seq 1 (covered to ack + 5 s) and seq 3 (second interval) are owed; seq 2 is not
    assert result["lost_clean"] == 2
    assert result["per_subscriber"]["cs"]["owed"] == 2


def test_redelivery_is_a_duplicate_not_a_reorder() -> None:
    history = [acked(s, float(s)) for s in (1, 2, 3)]
    deliveries = [got(1, 1.1), got(2, 2.1), got(2, 2.2), got(3, 3.1)]
    result = check_delivery([SubscriberRecord("ps", False, deliveries, 0.5, [])], history)
    assert (result["duplicates"], result["reorders"], result["lost_persistent"]) == (1, 0, 0)


def test_a_second_copy_at_qos2_breaks_exactly_once_and_one_at_qos1_does_not() -> None:
    history = [acked(s, float(s)) for s in (1, 2)]
    at_qos2 = [Delivery(1.1, "t", "p", 1, 1, False, False, 2),
               Delivery(1.2, "t", "p", 1, 1, True, False, 2),
               Delivery(2.1, "t", "p", 1, 2, False, False, 1),
               Delivery(2.2, "t", "p", 1, 2, True, False, 1)]
    result = check_delivery([SubscriberRecord("ps", False, at_qos2, 0.5, [])], history)
    assert (result["duplicates"], result["qos2_duplicates"]) == (2, 1)
    report = {"delivery": result, "retained": {"regressions": []},
              "dual_sessions": {"violations": 0}, "convergence": {"seconds": 1.0},
              "wills": [], "crashes": {"unexpected_exits": [], "tracebacks": {}}}
    assert verdict(report) == ["1 messages delivered at QoS 2 more than once "
                               "(exactly once broken)"]


def test_late_new_message_is_a_reorder_but_only_within_a_connection() -> None:
    history = [acked(1, 1.0), acked(2, 2.0), acked(1, 3.0, conn=2)]
    same = [got(2, 2.1), got(1, 2.2)]
    assert check_delivery([SubscriberRecord("a", False, same, 0.5, [])],
                          history[:2])["reorders"] == 1
    across = [got(2, 2.1, conn=1), got(1, 3.1, conn=2)]
    history2 = [acked(2, 2.0), Acked("p", 2, 1, "t", 3.0, 3.01)]
    assert check_delivery([SubscriberRecord("b", False, across, 0.5, [])],
                          history2)["reorders"] == 0


def test_retained_regression_and_missing() -> None:
    r = check_retained({"r/0": 10, "r/1": 5},
                       {"n1": {"r/0": 10, "r/1": 6}, "n2": {"r/0": 9, "r/1": None}})
    assert [(x["node"], x["topic"]) for x in r["regressions"]] == [("n2", "r/0"),
                                                                   ("n2", "r/1")]


def test_stall_and_dual_bounds() -> None:
    assert max_gap([1.0, 2.0, 6.0], 0.0, 7.0) == 4.0
    assert max_gap([], 0.0, 3.0) == 3.0
    assert check_dual([{"overlap_s": 5.5}, {"overlap_s": 0.2}])["violations"] == 1
