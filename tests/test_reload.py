"""``mqttring.reload.plan_reload``: which settings a SIGHUP applies and which need a restart
(a pure function; the signal itself is exercised in tests/test_node_lifecycle.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from mqttring.config import BrokerConfig, Limits
from mqttring.reload import LIVE_SETTINGS, plan_reload, settings


def test_live_settings_are_applied_and_the_rest_named():
    old = BrokerConfig()
    new = replace(old, allow_anonymous=False, num_shards=64, log_level="debug",
                  acl_file=Path("/etc/mqttring/acl"),
                  limits=replace(old.limits, max_inflight=64, max_packet_size=4096))
    plan = plan_reload(old, new)
    described = [c.describe() for c in plan.applied]
    assert "limits.max_inflight 32 -> 64" in described
    assert "allow_anonymous True -> False" in described
    assert "log_level 'info' -> 'debug'" in described
    assert "acl_file None -> '/etc/mqttring/acl'" in described
    assert set(plan.needs_restart) == {"num_shards", "limits.max_packet_size"}
    # The node runs on with the new live values and its old restart-only ones.
    assert plan.config.limits.max_inflight == 64 and plan.config.allow_anonymous is False
    assert plan.config.num_shards == old.num_shards
    assert plan.config.limits.max_packet_size == old.limits.max_packet_size


def test_nothing_changed_is_an_empty_plan():
    config = BrokerConfig()
    plan = plan_reload(config, BrokerConfig())
    assert plan.applied == () and plan.needs_restart == () and plan.config is config


def test_every_live_setting_names_a_real_setting():
    assert set(LIVE_SETTINGS) <= set(settings(BrokerConfig(limits=Limits())))


def test_mqtt5_connection_settings_reload_for_new_connections():
    old = BrokerConfig()
    new = replace(old, response_information="r/", limits=replace(
        old.limits, max_keepalive=60, topic_alias_maximum_out=8))
    plan = plan_reload(old, new)
    assert plan.needs_restart == ()
    assert (plan.config.response_information, plan.config.limits.max_keepalive,
            plan.config.limits.topic_alias_maximum_out) == ("r/", 60, 8)


def test_the_limits_documented_as_live_are_applied_for_new_sessions():
    """docs/configuration.md says a SIGHUP applies ``qos2_dedup_window`` to sessions created
    after it, like ``max_inflight``; the node said it needed a restart (a probe)."""
    old = BrokerConfig()
    new = replace(old, limits=replace(old.limits, qos2_dedup_window=16, max_inflight=64))
    plan = plan_reload(old, new)
    assert plan.needs_restart == ()
    assert "limits.qos2_dedup_window 4096 -> 16" in [c.describe() for c in plan.applied]
