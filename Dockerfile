# One image for every gpupipe service; the subcommand picks the role.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY gpupipe gpupipe
COPY producer producer
COPY consumers consumers
COPY schemas schemas
RUN pip install --no-cache-dir . && useradd -r -u 10001 gpupipe
# Consumers run as this unprivileged user. The node producer's DaemonSet overrides it on purpose
# (runAsUser: 0, every capability dropped: see deploy/kubernetes/producer-daemonset.yaml), because
# the kubelet socket and the hostPath spool are root-owned; tests/unit/deploy/test_producer_manifest.py
# keeps the two in agreement.
USER 10001
ENTRYPOINT ["gpupipe"]
CMD ["--help"]
