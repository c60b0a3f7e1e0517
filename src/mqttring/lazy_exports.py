"""A package's public names imported on first use (PEP 562), for ``mqttring`` and
``mqttring.raft``: a process started with ``python -m`` imports those packages before its
own first line runs, and must hold stop signals (``mqttring.stop_signals``) before the
second or so that importing the broker or pysyncobj takes.  Standard library only."""

from __future__ import annotations

import importlib

TYPE_CHECKING = False  # type checkers take it as typing.TYPE_CHECKING; importing typing: 10 ms

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, str], namespace: dict[str, object]
                 ) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``, whose public names map to the
    modules defining them in ``exports``; ``namespace`` is the package's ``globals()``,
    where a name imported once is kept (later look-ups do not come back here)."""

    def getattr_(name: str) -> object:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted([*namespace, *exports])

    return getattr_, dir_
