# One image for every gpupipe service; the subcommand picks the role.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY gpupipe gpupipe
COPY producer producer
COPY consumers consumers
COPY schemas schemas
RUN pip install --no-cache-dir . && useradd -r -u 10001 gpupipe
USER 10001
ENTRYPOINT ["gpupipe"]
CMD ["--help"]
