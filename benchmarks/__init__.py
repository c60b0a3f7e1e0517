"""mqttring's benchmark suite: ``python -m benchmarks compare`` (see docs/benchmarks.md).

A load generator of its own (``loadgen``, ``wire``), a sink that proves the generator is not
the bottleneck (``sink``), broker launchers (``brokers``), the scenarios (``scenarios``,
``cluster``) and the report writer (``report``).
"""
