"""Sans-IO MQTT 3.1.1: packets, codec, topics and the per-connection session machine."""
