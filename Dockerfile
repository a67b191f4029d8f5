# The gpupipe images. BASE is any Debian-like image with Python 3.11+ and its venv module: the
# official python:3.11-slim by default, or a base made from Debian's packages where Docker Hub cannot
# be reached (scripts/image-build; tests/integration/deploy/test_image.py builds and runs both targets).
#   gpupipe        (the default, last stage) every service; the subcommand picks the role
#   gpupipe-agent  (--target agent) the node agent and the kmsg relay only: none of the consumers'
#                  dependencies ([tool.gpupipe.image] agent-omits in pyproject.toml)
ARG BASE=python:3.11-slim

FROM ${BASE} AS source
COPY pyproject.toml README.md /src/
COPY gpupipe /src/gpupipe
COPY producer /src/producer
COPY consumers /src/consumers
COPY schemas /src/schemas

# Behind a proxy that re-signs TLS, pass its CA: --build-arg PIP_CERT=/path plus a volume mounting the
# file there (scripts/image-build does it with this machine's bundle). Build arguments stay out of the
# images: only the build stages see them.
FROM source AS agent-build
ARG PIP_CERT PIP_INDEX_URL
RUN python3 -m venv /opt/gpupipe \
 && python3 -c 'import re, tomllib; p = tomllib.load(open("/src/pyproject.toml", "rb")); omit = set(p["tool"]["gpupipe"]["image"]["agent-omits"]); print("\n".join(d for d in p["project"]["dependencies"] if re.split(r"[\[<>=!~ ;]", d)[0] not in omit))' >/tmp/agent-requirements.txt \
 && /opt/gpupipe/bin/pip install --no-cache-dir --no-compile -r /tmp/agent-requirements.txt \
 && /opt/gpupipe/bin/pip install --no-cache-dir --no-compile --no-deps /src

FROM source AS full-build
ARG PIP_CERT PIP_INDEX_URL
RUN python3 -m venv /opt/gpupipe && /opt/gpupipe/bin/pip install --no-cache-dir --no-compile /src

# The node agent's image. Its DaemonSet runs it as root with every capability dropped (the kubelet
# socket and the hostPath spool are root-owned: deploy/kubernetes/producer-daemonset.yaml).
FROM ${BASE} AS agent
COPY --from=agent-build /opt/gpupipe /opt/gpupipe
ENV PATH=/opt/gpupipe/bin:$PATH PYTHONDONTWRITEBYTECODE=1
ENTRYPOINT ["gpupipe"]
CMD ["produce", "--help"]

FROM ${BASE} AS gpupipe
COPY --from=full-build /opt/gpupipe /opt/gpupipe
ENV PATH=/opt/gpupipe/bin:$PATH PYTHONDONTWRITEBYTECODE=1
RUN echo 'gpupipe:x:10001:10001:gpupipe:/nonexistent:/usr/sbin/nologin' >>/etc/passwd \
 && echo 'gpupipe:x:10001:' >>/etc/group
# Consumers run as this unprivileged user. The node producer's DaemonSet overrides it on purpose
# (runAsUser: 0, every capability dropped: see deploy/kubernetes/producer-daemonset.yaml), because
# the kubelet socket and the hostPath spool are root-owned; tests/unit/deploy/test_producer_manifest.py
# keeps the two in agreement.
USER 10001
ENTRYPOINT ["gpupipe"]
CMD ["--help"]
