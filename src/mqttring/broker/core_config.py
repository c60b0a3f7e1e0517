"""What the core derives from a ``BrokerConfig``: built at start and again at each reload
(``BrokerCore.apply_settings``), so both read the config the same way."""

from __future__ import annotations

from mqttring.config import BrokerConfig
from mqttring.protocol.connection5 import ServerLimits5
from mqttring.protocol.session import SessionLimits


def login_settings(config: BrokerConfig) -> tuple[object, ...]:
    """The settings an ``Authenticator`` is built from: a reload that changes one builds
    a new one."""
    return (config.allow_anonymous, config.password_file, config.auth_failures_allowed,
            config.auth_failure_window)


def limits5(config: BrokerConfig) -> ServerLimits5:
    return ServerLimits5(topic_alias_maximum_out=config.limits.topic_alias_maximum_out,
                         response_information=config.response_information,
                         max_user_properties=config.limits.max_user_properties)


def session_limits(config: BrokerConfig) -> SessionLimits:
    return SessionLimits(
        max_inflight=config.limits.max_inflight,
        max_queued=config.limits.max_queued,
        max_output=config.limits.max_outgoing_buffer,
        message_ttl=config.limits.queued_message_ttl,
        hold_when_online=config.limits.slow_subscriber_hold > 0,
        qos2_dedup_window=config.limits.qos2_dedup_window,
        # A retry's copy comes within the edge's patience, then the owner's, of the first.
        qos2_dedup_seconds=2 * config.cluster_write_patience,
    )
