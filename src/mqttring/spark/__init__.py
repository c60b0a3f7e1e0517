"""PySpark jobs over mqttring exports (extra ``mqttring[spark]``; docs/analytics.md).

Import the functions from here (``from mqttring.spark import read_export, topic_stats``);
PySpark is imported on first use, so that ``mqttring``'s command line works without it.
"""

from __future__ import annotations

__all__ = [
    "ExportTables",
    "TopicStats",
    "build_session",
    "client_backlog",
    "compute_topic_stats",
    "format_summary",
    "prefix_stats",
    "read_export",
    "retained_inventory",
    "run_topic_stats",
    "topic_prefix",
    "topic_stats",
]


def __getattr__(name: str) -> object:
    """Lazy re-exports of ``mqttring.spark.jobs`` (which imports pyspark)."""
    if name in __all__:
        from mqttring.spark import jobs

        return getattr(jobs, name)
    raise AttributeError(name)
