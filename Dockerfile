# mqttring node image: slim Python, non-root, data on a volume.
#   docker build -t mqttring .
#   docker run -p 1883:1883 -v mqttring-data:/var/lib/mqttring mqttring
# A 3-node cluster: deploy/docker-compose.yml.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml setup.cfg README.md ./
COPY src ./src
# A wheel, so that the final image carries no build tools or sources.
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
RUN groupadd --system mqttring \
 && useradd --system --gid mqttring --home-dir /var/lib/mqttring --shell /usr/sbin/nologin mqttring \
 && mkdir -p /var/lib/mqttring /etc/mqttring \
 && chown mqttring:mqttring /var/lib/mqttring
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
USER mqttring
WORKDIR /var/lib/mqttring
VOLUME ["/var/lib/mqttring"]
# 1883 MQTT, 8083 MQTT over WebSocket, 7000 cluster links and admin RPC, 7001 Raft.
EXPOSE 1883 8083 7000 7001
# Alive = the MQTT port accepts a connection (the image has no curl; Python is there anyway).
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s \
  CMD ["python", "-c", "import socket; socket.create_connection(('127.0.0.1', 1883), 2).close()"]
ENTRYPOINT ["mqttring", "node"]
# Listen on every interface inside the container; data in the volume.  Add --config, or
# MQTTRING_* environment variables, for more (docs/configuration.md).
CMD ["--mqtt", "0.0.0.0:1883", "--data-dir", "/var/lib/mqttring"]
