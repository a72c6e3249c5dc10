# make run  : serve everything at http://127.0.0.1:$(PORT)/ (embedded mode: SQLite, no services)
# make test : lint and the docs, then the whole suite on SQLite and on the machine's PostgreSQL at once
# make migrate: the release step (make run refuses a PostgreSQL database that lacks migrations)
# make ctl ARGS="restart workers:worker": restart one process of a running make run
# make demo : demo traffic for the dashboard (or `DEMO=1 make run` runs it beside the server)
# make shop : the example Django project (examples/shop) on SHOP_PORT, beside a running
#             `MQ_WEBHOOK_ALLOW_PRIVATE=true make run`: its orders published, its webhook posted to
# make faults: the long fault-injection run (about 30 minutes; make test runs a short one)
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PORT ?= 8000
# Where `make run` keeps supervisord's log, pid file, control socket (make ctl) and beat schedule.
RUN_DIR ?= var

.PHONY: run migrate ctl install install-dev test lint test-sqlite test-postgres test-sqlite-e2e test-sqlite-rest \
	test-postgres-e2e test-postgres-rest bench clean demo shop
# The browser test drives Debian's Chromium (never a browser download); we run as root.
CHROMIUM := /usr/bin/chromium

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# What `make run` needs (requirements.txt), reinstalled whenever it changes. The Python client
# (clients/python, package mqclient) goes in editable, so its source is what `import mqclient`
# runs (the demo traffic uses it).
$(VENV)/.installed: requirements.txt clients/python/pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements.txt
	$(BIN)/pip install --quiet -e clients/python
	touch $@

install: $(VENV)/.installed $(VENV)/.spark-classes

# What only the tests, the linter and the docs need, on top (requirements-dev.txt).
$(VENV)/.dev-installed: requirements-dev.txt $(VENV)/.installed
	$(BIN)/pip install --quiet -r requirements-dev.txt
	touch $@

install-dev: install $(VENV)/.dev-installed

run: install
	@# Migrated here on a developer's machine; in production settings (MQ_HTTPS) a database that
	@# lacks migrations is refused: make migrate first (MQ_MIGRATE_ON_RUN; docs/operations/index.md).
	$(BIN)/python manage.py ensuremigrated
	$(BIN)/python manage.py bootstrap
	mkdir -p $(RUN_DIR)
	@# The processes' latency histograms (PROMETHEUS_MULTIPROC_DIR, mqsite/prometheus.py): a new start counts from zero.
	rm -rf $(RUN_DIR)/metrics && mkdir $(RUN_DIR)/metrics
	@# exec: make's SIGTERM goes to supervisord itself, not to a shell that would leave it running;
	@# --pdeathsig: supervisord stops everything should make be killed outright (supervisord.conf).
	@# supervisord reads the web processes' count and address from the settings, as checked there.
	web=$$($(BIN)/python manage.py shell -v 0 -c 'from django.conf import settings as s; print(s.MQ_WEB_PROCESSES, s.MQ_BIND_ADDRESS)') && \
	read -r processes address <<< "$$web" && \
	PORT=$(PORT) MQ_RUN_DIR=$(abspath $(RUN_DIR)) PROMETHEUS_MULTIPROC_DIR=$(abspath $(RUN_DIR))/metrics \
	MQ_DEMO_AUTOSTART=$(if $(DEMO),true,false) MQ_WEB_PROCESSES=$$processes MQ_BIND_ADDRESS=$$address \
	exec setpriv --pdeathsig TERM $(BIN)/supervisord -c mqsite/supervisord.conf

demo: install
	$(BIN)/python manage.py demo

# The example shop (examples/shop/README.md) beside the server a `make run` serves on PORT: the
# server gets queue db and a subscriber `shop` that publishes to db and is posted db/create at
# the shop's webhook (a new token each time: the old one stops working); the shop's SQLite
# file is migrated, and its runserver and its relay (manage.py mqrelay) run until Ctrl-C.
SHOP_PORT ?= 8001
shop: install
	$(BIN)/python manage.py createqueue db -v 0
	@# The webhook is on loopback, which the server allows only when told so (make run too); the
	@# token and the webhook secret go to a file only its owner reads.
	mkdir -p $(RUN_DIR) && umask 077 && MQ_WEBHOOK_ALLOW_PRIVATE=true $(BIN)/python manage.py createsubscriber shop --publish db --subscribe db \
		--webhook http://127.0.0.1:$(SHOP_PORT)/mq/webhook/ --json > $(RUN_DIR)/shop.json
	cd examples/shop && \
	export MQ_URL=http://127.0.0.1:$(PORT) \
		MQ_TOKEN=$$($(abspath $(BIN))/python -c 'import json,sys; print(json.load(sys.stdin)["token"])' < $(abspath $(RUN_DIR))/shop.json) \
		MQ_WEBHOOK_SECRET=$$($(abspath $(BIN))/python -c 'import json,sys; print(json.load(sys.stdin)["webhook_secret"])' < $(abspath $(RUN_DIR))/shop.json) && \
	$(abspath $(BIN))/python -c 'import os, mqclient; mqclient.Client(os.environ["MQ_URL"], os.environ["MQ_TOKEN"]).subscribe("db", "create")' && \
	$(abspath $(BIN))/python manage.py migrate --noinput -v 0 && \
	{ $(abspath $(BIN))/python manage.py mqrelay & relay=$$!; trap 'kill $$relay 2>/dev/null' EXIT; \
	  echo "the shop: http://127.0.0.1:$(SHOP_PORT)/orders/ (README: examples/shop/README.md)"; \
	  $(abspath $(BIN))/python manage.py runserver --noreload 127.0.0.1:$(SHOP_PORT); }

# The release step: the database's schema up to the code (back it up first in production).
migrate: install
	$(BIN)/python manage.py migrate --noinput

# supervisorctl on a running `make run` (same RUN_DIR), through its control socket: e.g.
# make ctl ARGS="restart workers:worker", ARGS=status (the default), ARGS="tail -f workers:beat".
ARGS ?= status
ctl:
	MQ_RUN_DIR=$(abspath $(RUN_DIR)) $(BIN)/supervisorctl -c mqsite/supervisord.conf $(ARGS)

$(CHROMIUM):
	apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium

# The JavaScript client's tests run it in Node too, which needs a global WebSocket (Node 22, or
# 20.10+ with a flag: the machines' NodeSource nodejs 20). Debian 12's own nodejs, installed
# here only where there is no node at all, is 18, which has none: those tests then fail, saying
# so, rather than skip (its browser test needs no node).
NODE := /usr/bin/node
$(NODE):
	apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y nodejs
# npm installs the JavaScript package from the checkout (tests/clients/test_client_js_package.py):
# NodeSource's nodejs brings it, Debian's own is the npm package.
NPM := /usr/bin/npm
$(NPM): | $(NODE)
	apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y npm

# The Spark job's tests need a Java runtime (PySpark 4 runs on Java 17), and the end-to-end
# tests start private redis-server processes (never the machine's own Redis on 6379).
JAVA := /usr/bin/java
$(JAVA):
	apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y default-jre-headless

# The local Spark driver's class archive (MQ_SPARK_CLASS_ARCHIVE, analytics/class_archive.py),
# so that the first analysis after an install starts its JVM as fast as later ones; made again
# whenever the packages are (another Spark has other classes). Best effort: without Java (make
# run needs none) or if it fails, the first analysis makes it as it exits.
$(VENV)/.spark-classes: $(VENV)/.installed
	if command -v java >/dev/null; then \
		$(BIN)/python manage.py sparkclasses --force || echo "no Spark class archive made: the first analysis will"; \
	fi
	touch $@

REDIS_SERVER := /usr/bin/redis-server
$(REDIS_SERVER):
	apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y redis-server

# The deployment's test runs Debian's nginx with deploy/nginx/mqsite.conf (tests/e2e/test_nginx.py).
NGINX := /usr/sbin/nginx
$(NGINX):
	apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y nginx-light

# promtool checks and unit-tests the manual's alert rules (docs/operations/prometheus-rules.yml):
# Debian ships it in the prometheus package (on a machine with systemd, its service starts too).
PROMTOOL := /usr/bin/promtool
$(PROMTOOL):
	apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus

# The PgBouncer test (tests/e2e/test_pgbouncer.py) starts a private one in transaction mode.
PGBOUNCER := /usr/sbin/pgbouncer
$(PGBOUNCER):
	apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y pgbouncer

# The deployment's units are checked with systemd-analyze verify, and the web unit's command run
# under systemd-socket-activate (tests/mqsite/test_deploy_files.py, tests/e2e/test_systemd_web.py).
SYSTEMD_ANALYZE := /usr/bin/systemd-analyze
$(SYSTEMD_ANALYZE):
	apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends systemd

# What the tests need from Debian, installed when missing (apt-get: as root). The PostgreSQL
# server itself is the machine's (docs/development.md).
TEST_TOOLS := $(CHROMIUM) $(NODE) $(NPM) $(JAVA) $(REDIS_SERVER) $(NGINX) $(PROMTOOL) $(PGBOUNCER) $(SYSTEMD_ANALYZE)

lint: install-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# One pass of the whole suite on each database (tests/support/run_pass.sh gives each pass its
# own test database, job folder and Redis, so that passes can run at once).
PG_SERVER ?= postgres://postgres@127.0.0.1:5432
RUN_PASS := BIN=$(BIN) PG_SERVER=$(PG_SERVER) bash tests/support/run_pass.sh

test-sqlite: install-dev $(TEST_TOOLS)
	$(RUN_PASS) sqlite sqlite

test-postgres: install-dev $(TEST_TOOLS)
	REDIS=machine $(RUN_PASS) postgres postgres

# `make test` cuts each database's pass in two and runs the four at once: the tests that start
# real processes (tests/e2e, tests/clients) spend most of their time waiting on servers,
# sockets and timers, so beside the others they cost two cores little. Each part prints its
# output whole when it ends (--output-sync), with its slowest tests.
E2E_TESTS := tests/e2e tests/clients
NOT_E2E := $(addprefix --ignore=,$(E2E_TESTS))

test-sqlite-e2e: install-dev $(TEST_TOOLS)
	$(RUN_PASS) sqlite sqlite-e2e $(E2E_TESTS)
test-sqlite-rest: install-dev $(TEST_TOOLS)
	$(RUN_PASS) sqlite sqlite-rest $(NOT_E2E)
test-postgres-e2e: install-dev $(TEST_TOOLS)
	$(RUN_PASS) postgres postgres-e2e $(E2E_TESTS)
test-postgres-rest: install-dev $(TEST_TOOLS)
	REDIS=machine $(RUN_PASS) postgres postgres-rest $(NOT_E2E)

# Lint and the manual first, and the Debian packages one apt-get at a time, then the parts;
# then no test may have been skipped by every part (each may leave a test to another).
test: lint docs $(TEST_TOOLS)
	rm -rf var/test-reports
	MQ_TEST_REPORTS=var/test-reports $(MAKE) --no-print-directory --output-sync=target -j4 \
		test-sqlite-e2e test-postgres-e2e test-sqlite-rest test-postgres-rest
	$(BIN)/python tests/support/never_run.py var/test-reports

# The benchmark's own clients (RabbitMQ, NATS, py-spy) go into the same venv; reinstalled
# whenever bench/requirements.txt changes.
$(VENV)/.bench-installed: bench/requirements.txt $(VENV)/.dev-installed
	$(BIN)/pip install --quiet -r bench/requirements.txt
	touch $@

# Not part of `make test`. The comparison with RabbitMQ, NATS JetStream, Redis Streams and the
# PostgreSQL ceiling at full sizes (it puts its table into bench/README.md), then the profiles,
# then the operators' benchmark at 10 million rows: W5's database (kept by compare.py) with the
# 2 million pending deliveries of `bench-operators` made through the API on top of it. Each
# runs even if one before it fails; the target fails if any does. The older single-purpose
# benchmarks stay runnable on their own: bench/publish_rate.py and bench/ws_latency.py.
bench: install $(VENV)/.bench-installed
	bash bench/start_services.sh
	status=0; \
	$(BIN)/python bench/compare.py --update-readme || status=1; \
	$(BIN)/python bench/profile_server.py || status=1; \
	$(BIN)/python bench/operators.py --on-w5 --update-readme || status=1; \
	exit $$status

# The same comparison at a tenth of the sizes, without the profiles (a few minutes).
.PHONY: bench-quick
bench-quick: install $(VENV)/.bench-installed
	bash bench/start_services.sh
	$(BIN)/python bench/compare.py --scale 0.1 --limit 30

# W7 alone (issue 28's ordered drain: socket, REST pull, webhook, and RabbitMQ's single active
# consumer), in the services mode: about a minute, to compare before and after a change.
.PHONY: bench-ordered
bench-ordered: install $(VENV)/.bench-installed
	bash bench/start_services.sh
	$(BIN)/python bench/compare.py --scale 0.1 --limit 30 --modes services --workloads W7 --peers rabbitmq

# What operators wait for at 2 million pending deliveries made through the API in the services
# mode: every admin page, the dashboard's socket, /metrics, queuestats, a pull, publishes beside
# open dashboards (bench/README.md). The backlog is kept as a template database between runs
# (the first run makes it, in a few minutes); `bench/operators.py --rebuild` makes it again.
.PHONY: bench-operators
bench-operators: install
	bash bench/start_services.sh postgresql redis
	$(BIN)/python bench/operators.py --update-readme

# Issue 19's analytics benchmark: `manage.py analyze --json` run as an operator runs it (a new
# process each time, SPARK_MASTER=local[2]) on 5 million acked deliveries in the archive's own
# layout, hourly files and compacted ones, beside a live set in the hot tables: a first run, a
# rerun with nothing new, a run after one new hourly file, and smaller histories to fit the
# fixed cost and the rows a second per core. Every run's figures are checked against DuckDB;
# the target fails on a disagreement. A SQLite file unless DATABASE_URL names a PostgreSQL
# database with "bench" in its name (dropped and made again). About 15 minutes (bench/README.md).
.PHONY: bench-analytics
bench-analytics: install-dev
	$(BIN)/python bench/analytics_run.py

# Not part of `make test`, which runs a short form (tests/e2e/test_faults.py). The long fault run
# stops by itself: 100,000 messages in the services mode (a private PostgreSQL cluster, which
# it also crashes, and a private Redis; neither is the machine's), then 10,000 in the embedded
# mode. Both run even if the first fails; the target fails if either does. The figures go to
# var/faults/.
.PHONY: faults
faults: install-dev
	status=0; \
	$(BIN)/python -m tests.faults --mode services --messages 100000 --minutes 25 || status=1; \
	$(BIN)/python -m tests.faults --mode embedded --messages 10000 --minutes 4 || status=1; \
	exit $$status

clean:
	rm -rf $(VENV) var

# The manual (docs/, mkdocs.yml) as a site in site/. --strict: a warning (a broken link or
# anchor, a page left out of the nav) fails the build; a hook makes the settings table from
# mqsite/settings.py. NO_MKDOCS_2_WARNING quiets mkdocs-material's banner about its successor.
.PHONY: docs
docs: install-dev
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site
