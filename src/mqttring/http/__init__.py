"""The node's HTTP listener: a JSON API, Prometheus ``/metrics`` and the dashboard.

This layer sits above the broker and the cluster (like ``mqttring.embedded``): it reads a
running ``BrokerNode`` and, in a cluster, asks the other members through the authenticated
admin RPC.  ``server.serve_http`` runs it on trio inside the node's nursery.
"""
