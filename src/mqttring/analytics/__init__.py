"""Analytics path out of the broker: node snapshots → Parquet (docs/analytics.md).

``export`` and ``schemas`` need pyarrow (extra ``mqttring[spark]``); importing this package
does not, so that the ``mqttring`` command works without it.
"""

from __future__ import annotations

__all__ = ["ExportError", "ExportResult", "export_snapshot", "read_export_manifest"]


class ExportError(Exception):
    """The input cannot be exported or analysed faithfully: the operator's to fix, not a bug.

    Missing or corrupt snapshots and exports, rows that do not have the documented shape, an
    output directory that already holds data.  Commands print it as one line and exit 1.
    """


def __getattr__(name: str) -> object:
    """Lazy re-exports: pyarrow is imported only when the export is actually used."""
    if name in ("ExportResult", "export_snapshot", "read_export_manifest"):
        from mqttring.analytics import export

        return getattr(export, name)
    raise AttributeError(name)
