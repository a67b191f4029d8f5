# gpupipe: the two commands a newcomer needs are `make demo` and `make test`.
SHELL := /bin/bash
PY ?= python3
## Test workers (pytest-xdist, one process each, each with its own broker): most integration tests wait
## on services, so two workers halve the suite's time on a 2-core machine. TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 2
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
## The reference (docs/, mkdocs.yml) as a site in site/ (gitignored). Strict: a broken link or anchor, or a
## page missing from the nav, fails the build. (Not --quiet: it hides the warnings that strict counts.)
DOCS_BUILD := $(BIN)/mkdocs build --strict --site-dir site

.PHONY: release deps deps-demo venv install test test-unit test-integration recipe-check lint docs fmt demo bench kafka-start kafka-stop compose-check proto clean chart-check contract typecheck

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP) $(DEMO_STAMP)

## The demo's share of the venv: gpupipe and its runtime dependencies only (no test tools, no Spark),
## into the same .venv (README's commands use .venv/bin/gpupipe); pip shows each package as it goes.
## `make venv` adds the dev extra on top; a full install counts as this one too.
DEMO_STAMP := $(VENV)/.installed-runtime
$(DEMO_STAMP): pyproject.toml
	@echo "demo: installing gpupipe and its runtime dependencies into $(VENV) (not the test tools) ..."
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -e .
	touch $(DEMO_STAMP)

install: venv

## Debian packages (Prometheus, promtool, Alertmanager, openssl, kcat, chromium, docker-compose), Kafka's jars
## and helm (built from its Go module once): installed when
## root, else one line naming the exact command (scripts/ensure-deps; GPUPIPE_SKIP_DEPS=1 skips it).
deps:
	scripts/ensure-deps

## The demo's share of deps: Kafka's jars, and Prometheus and Alertmanager (optional to the demo: as
## anyone but root a missing one is a note, not a stop); nothing that only the tests use.
deps-demo:
	scripts/ensure-deps --demo

## The whole suite, real services included (Kafka is started by the tests' own fixture).
test: deps venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(CONTRACT) --check
	$(TYPECHECK)
	$(DOCS_BUILD)
	$(BIN)/pytest -q -ra --durations=25 -n $(TEST_WORKERS) --dist loadfile -m 'not recipe_check' tests

## The recipes in other engines that take minutes (marker recipe_check: Flink SQL in a local MiniCluster
## on Flink's jars, fetched once from Maven Central by scripts/flink-jars), each against chargeback;
## CI runs it after `make test` (.ci/run).
recipe-check: deps venv
	scripts/flink-jars fetch
	$(BIN)/pytest -q -ra --durations=5 -m recipe_check tests/integration/recipes

test-unit: venv
	$(BIN)/pytest -q tests/unit

test-integration: deps venv
	$(BIN)/pytest -q -ra -m 'not recipe_check' tests/integration

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(CONTRACT) --check
	$(TYPECHECK)
	$(DOCS_BUILD)

docs: venv
	$(DOCS_BUILD)

## The code generated from schemas/*.avsc (schemas/codegen/: typed records, field groups), rewritten;
## `make lint` and `make test` run it with --check, which names each stale file and fails.
CONTRACT := $(BIN)/python -m gpupipe_schemas.codegen
contract: venv
	$(CONTRACT)

## mypy over the four packages (pyproject: tool.mypy; strict where records flow), as `make lint` and
## `make test` run it.
TYPECHECK := $(BIN)/python scripts/typecheck.py
typecheck: venv
	$(TYPECHECK)

fmt: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

## Local broker, simulated fleet and every consumer; Ctrl-C stops everything. A second `make demo`
## while one runs says so in one line and exits 2 (scripts/demo.py).
demo: deps-demo $(DEMO_STAMP)
	$(BIN)/python scripts/demo.py

## Benchmarks print `NAME ratio=X target=Y` lines (higher is better). Not part of `make test`.
bench: venv
	$(BIN)/python bench/run_all.py

## dist/: the wheel, the packaged chart (dist/ is a chart repository) and, with a Docker engine, the
## image, all of pyproject.toml's version (scripts/release: IMAGE, RELEASE_IMAGE, CHART_OCI, ...).
release: venv
	PY=$(BIN)/python scripts/release

kafka-start:
	scripts/kafka-local start

kafka-stop:
	scripts/kafka-local stop

## docker-compose validates the file; compose_ports.py refuses a host port that two services publish
## (valid to docker-compose, but `docker compose up` then fails to bind the second); compose_kafka_data.py
## refuses a Kafka whose log directory is not in its volume (recreating the container would lose the data).
compose-check: venv
	docker-compose -f docker-compose.yml config -q
	$(BIN)/python scripts/compose_ports.py docker-compose.yml
	$(BIN)/python scripts/compose_kafka_data.py docker-compose.yml

## Helm chart: lint, render and validate (helm is built from its Go module once when missing).
chart-check: venv
	$(BIN)/pytest -q tests/integration/deploy/test_helm_chart.py

proto: venv
	scripts/gen-proto

clean:
	rm -rf $(VENV) .run .pytest_cache .ruff_cache site
