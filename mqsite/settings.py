"""Settings, read from the environment (docs/settings.md lists them, from the comments here).

The defaults are the embedded mode: a SQLite file under var/, no outside services.
A malformed value stops start-up with a message naming the variable.
"""

import ipaddress
import json
import os
import re
import secrets
from datetime import timedelta
from pathlib import Path

import environ
from django.core.exceptions import ImproperlyConfigured

from mqsite import db_budget
from mqsite.private_files import read_or_create_private
from mqsite.rates import parse_rate
from mqsite.version import VERSION

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = BASE_DIR / "var"
VAR_DIR.mkdir(exist_ok=True)

env = environ.Env()


def _spark_conf(name, default):
    """A JSON object of Spark settings (names to strings, numbers or booleans) as a dict of
    strings, as Spark takes them."""
    text = env.str(name, default=default).strip() or default
    try:
        conf = json.loads(text)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name} must be a JSON object of Spark settings: {exc}") from None
    if not isinstance(conf, dict):
        raise ImproperlyConfigured(f"{name} must be a JSON object of Spark settings, not {text!r}")
    for key, value in conf.items():
        if not key.startswith("spark.") or not isinstance(value, str | int | float | bool):
            raise ImproperlyConfigured(
                f"{name}: {key!r} is not a Spark setting (spark.*) with a string, number or boolean value"
            )
    return {key: str(value).lower() if isinstance(value, bool) else str(value) for key, value in conf.items()}


def _positive_int(name, default):
    value = env.int(name, default=default)
    if value <= 0:
        raise ImproperlyConfigured(f"{name} must be a positive whole number, not {value}")
    return value


def _whole_number(name, default):
    value = env.int(name, default=default)
    if value < 0:
        raise ImproperlyConfigured(f"{name} must be 0 or a positive whole number, not {value}")
    return value


def _positive_float(name, default):
    value = env.float(name, default=default)
    if not value > 0:  # NaN too
        raise ImproperlyConfigured(f"{name} must be a positive number, not {value}")
    return value


def _secret_key():
    """SECRET_KEY from the environment, else one made once and kept in var/ (embedded mode)."""
    # Django's signing key: set it in production; else one made once and kept in var/secret_key.
    if env.str("SECRET_KEY", default=""):
        return env.str("SECRET_KEY")
    return read_or_create_private(VAR_DIR / "secret_key", lambda: secrets.token_urlsafe(50))


SECRET_KEY = _secret_key()
# Django's debug pages: never on a server others reach.
DEBUG = env.bool("DEBUG", default=False)
# Host names the server answers; a websocket handshake whose Origin names another is refused.
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "[::1]"])
# Origins (scheme://host[:port]) whose form posts and staff API calls CSRF accepts beside the
# request's own host: behind a proxy on a port other than 443 (or 80), or when the admin is
# reached under another name than the proxy passes as Host (docs/deploy.md).
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])
for _origin in CSRF_TRUSTED_ORIGINS:
    if not re.fullmatch(r"https?://[^/\s]+", _origin):
        raise ImproperlyConfigured(
            f"CSRF_TRUSTED_ORIGINS holds {_origin!r}: each is scheme://host[:port] (https://mq.example.com)"
        )
# The port `make run` serves on.
PORT = _positive_int("PORT", 8000)
# The IPv4 address `make run` serves on: loopback by default, behind a proxy on the same
# machine; 0.0.0.0 for every interface (a container, or a proxy on another machine).
MQ_BIND_ADDRESS = env.str("MQ_BIND_ADDRESS", default="127.0.0.1")
try:
    ipaddress.IPv4Address(MQ_BIND_ADDRESS)
except ValueError:
    raise ImproperlyConfigured(
        f"MQ_BIND_ADDRESS must be an IPv4 address (127.0.0.1, 0.0.0.0), not {MQ_BIND_ADDRESS!r}"
    ) from None

# Not "daphne": its app only makes `runserver` serve ASGI, and installing it put the Twisted
# reactor (0.3 s) into the start of every manage.py command and Celery worker. `make run`
# serves with Daphne itself (`python -m daphne mqsite.asgi:application`), as production does.
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "whitenoise.runserver_nostatic",
    "django.contrib.staticfiles",
    "axes",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "channels",
    "django_celery_beat",
    "queues",
    "subscribers",
    "delivery",
    "analytics",
    "dashboard",
]

# Django's own, but a bearer-token call to /api/ skips the session, authentication and
# messages middleware (mqsite/middleware.py): it needs none of them. CSRF's stays Django's own
# (`check --deploy` looks for it by name): on an API call it does nothing but read the cookie
# header, since DRF's views are csrf_exempt and DRF checks a session's calls itself.
MIDDLEWARE = [
    # First: the request's id, for every answer and every line logged while serving it.
    "mqsite.request_ids.RequestId",
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "mqsite.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "mqsite.middleware.AuthenticationMiddleware",
    "mqsite.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "mqsite.middleware.CSPMiddleware",
    # Turns a locked-out login into its answer (429); one attribute read on other requests.
    "axes.middleware.AxesMiddleware",
]

# The Content-Security-Policy of every page (dashboard, admin, API docs): scripts only from our
# own static files (no inline script, so an injected <script> or onclick= does not run), and
# connections (fetch, the dashboard's websocket) only to this origin. Inline styles stay
# allowed: the admin and the dashboard's bars set style attributes, and a style cannot run code.
# Swagger UI draws its icons from data: URLs. Framing is refused, as X-Frame-Options says.
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": ["'self'"],
        "script-src": ["'self'"],
        "style-src": ["'self'", "'unsafe-inline'"],
        "img-src": ["'self'", "data:"],
        "font-src": ["'self'", "data:"],
        "connect-src": ["'self'"],
        "object-src": ["'none'"],
        "base-uri": ["'self'"],
        "form-action": ["'self'"],
        "frame-ancestors": ["'none'"],
    }
}

ROOT_URLCONF = "mqsite.urls"
ASGI_APPLICATION = "mqsite.asgi.application"
WSGI_APPLICATION = None

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# --- Database -------------------------------------------------------------------------------
# The database: a SQLite file by default (the embedded mode), or postgres://user@host:5432/name.
DATABASES = {"default": env.db("DATABASE_URL", default=f"sqlite:///{VAR_DIR / 'mqsite.sqlite3'}")}
# PostgreSQL is reached through a pooler in transaction mode (PgBouncer's pool_mode=transaction):
# nothing may rely on a server session lasting from one transaction to the next (docs/operations/index.md,
# PgBouncer). It turns off the startup option setting plan_cache_mode, server-side cursors and,
# unless MQ_DB_PREPARE says otherwise, prepared statements.
MQ_DB_TRANSACTION_POOLER = env.bool("MQ_DB_TRANSACTION_POOLER", default=False)
# The hot statements prepared on the server (mqsite/adb.py). A prepared statement belongs to a
# server session: behind a transaction pooler only PgBouncer 1.22+ with max_prepared_statements
# keeps track of them (then set it true); off, each statement is planned at every run.
MQ_DB_PREPARE = env.bool("MQ_DB_PREPARE", default=not MQ_DB_TRANSACTION_POOLER)
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {
            # Several threads and processes write at once: WAL lets readers run beside the one
            # writer; IMMEDIATE takes the write lock at BEGIN, so two transactions never both
            # read and then fail to upgrade (SQLITE_BUSY mid-transaction); the timeout waits
            # for the lock instead of failing. synchronous=FULL: a 201 means the publish is on
            # disk, as the contract promises.
            "transaction_mode": "IMMEDIATE",
            "timeout": 30,
            "init_command": ("PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL; PRAGMA foreign_keys=ON;"),
        }
    )
    # Django's SQLite backend, with this process's write transactions queued on one lock
    # (mqsite/workarounds/sqlite/base.py says why).
    DATABASES["default"]["ENGINE"] = "mqsite.workarounds.sqlite"
    # The SQLite file the tests use (one per test run, so two runs on one machine never share one).
    DATABASES["default"]["TEST"] = {"NAME": env.str("MQ_TEST_SQLITE", default=str(VAR_DIR / "test.sqlite3"))}
    # Opening a SQLite connection (and its PRAGMAs) costs more than most queries: keep it.
    # Unlike a server database, an idle open file costs nothing and there is no limit to reach.
    DATABASES["default"]["CONN_MAX_AGE"] = None
else:
    # Under ASGI each request runs in a thread of its own, so persistent connections would
    # pile up (one per thread, until PostgreSQL refuses more): use psycopg's pool instead.
    # Prepared statements (mqsite/adb.py: the hot ones; Django's own are never prepared) take
    # their generic plan, planned once per connection. Left to choose, PostgreSQL kept planning
    # the publish statement afresh at every run (0.6 ms a publish, 35 % of W1a) because its
    # generic plan's estimate looked worse than the custom plans it had tried; measured in
    # process, one publish: 1.52 ms left to choose, 1.13 ms generic, 1.90 ms custom.
    _options = DATABASES["default"].setdefault("OPTIONS", {})
    if not MQ_DB_TRANSACTION_POOLER:  # a pooler refuses the startup option: set it on the role
        _options["options"] = f"{_options.get('options', '')} -c plan_cache_mode=force_generic_plan".strip()
    else:
        # A server-side cursor (QuerySet.iterator()) lives in a session between transactions.
        DATABASES["default"]["DISABLE_SERVER_SIDE_CURSORS"] = True
    DATABASES["default"]["OPTIONS"]["pool"] = {
        "min_size": 2,
        # PostgreSQL connections per process in the pool of sync Django code (a web process's:
        # MQ_WEB_DB_POOL_MAX_SIZE). 20: a webhook worker's 16 threads and its own two.
        "max_size": env.int("DB_POOL_MAX_SIZE", default=20),
        "timeout": 10,
    }
# The socket's publishes, leases, acks and nacks run on an async pool of their own, on the
# event loop (mqsite/adb.py); MQ_ASYNC_DB=false runs them in threads as the rest of the code
# (for comparison). SQLite always does. Its size: MQ_ASYNC_DB_POOL_MAX_SIZE, below.
MQ_ASYNC_DB = env.bool("MQ_ASYNC_DB", default=True)

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- Redis (services mode) ------------------------------------------------------------------
# Redis (redis://host:6379/0): wake-ups between processes, the cache, Celery's jobs. Empty: none.
REDIS_URL = env.str("REDIS_URL", default="")
# The services mode: PostgreSQL and Redis. Without either, the embedded mode's one process.
SERVICES_MODE = bool(REDIS_URL) and DATABASES["default"]["ENGINE"] != "mqsite.workarounds.sqlite"

# Daphne processes `make run` starts on one port (mqsite/supervisord.conf: they share its
# socket), each serving REST and websockets. Only the services mode runs several: wake-ups,
# announcements, throttles and long-poll slots cross processes through Redis, and PostgreSQL
# takes writers from many. The embedded mode keeps one, since SQLite's writer lock is this
# process's (mqsite/workarounds/sqlite): several would fight over the file's lock instead of queueing.
# By default the CPU count, at most 8: more would not fit PostgreSQL's default max_connections
# (MQ_DB_MAX_CONNECTIONS, below).
MQ_WEB_PROCESSES = _positive_int(
    "MQ_WEB_PROCESSES", min(os.cpu_count() or 1, db_budget.MAX_DEFAULT_WEB_PROCESSES) if SERVICES_MODE else 1
)
if MQ_WEB_PROCESSES > 1 and not SERVICES_MODE:
    raise ImproperlyConfigured(
        "MQ_WEB_PROCESSES above 1 needs the services mode (a PostgreSQL DATABASE_URL and "
        "REDIS_URL); the embedded mode (SQLite) serves from one process"
    )

# The PostgreSQL connections of PostgreSQL's max_connections that these processes may use
# together (on one machine; when several machines or other clients share the server, give each
# its part). docs/operations/index.md, "PostgreSQL connections".
MQ_DB_MAX_CONNECTIONS = _positive_int("MQ_DB_MAX_CONNECTIONS", 100)
# Of those, left to others: PostgreSQL's superuser_reserved_connections (3), manage.py commands
# (an archive, an analysis, a migration), psql, a monitoring agent.
MQ_DB_RESERVED_CONNECTIONS = _whole_number("MQ_DB_RESERVED_CONNECTIONS", 10)
# The budget (mqsite/db_budget.py): the workers and beat open what their threads need
# (DB_POOL_MAX_SIZE caps each process's sync pool); each web process's two pools share what is
# left, at most 20 each (fewer async ones starved a fan-out to 10 socket subscribers: W2
# 1,900/s with 10 against 4,500 to 5,000 with 20, bench/PROFILE.md section 10).
_budget_sync, _budget_async = db_budget.web_share(
    MQ_DB_MAX_CONNECTIONS - MQ_DB_RESERVED_CONNECTIONS, MQ_WEB_PROCESSES
)
_DB_POOL_MAX_SIZE = (DATABASES["default"].get("OPTIONS", {}).get("pool") or {}).get("max_size", 20)
# Connections of the sync pool of each web process, in place of DB_POOL_MAX_SIZE there: by
# default its share of the budget (2 web processes: 15; 4: 7), and no more than DB_POOL_MAX_SIZE.
MQ_WEB_DB_POOL_MAX_SIZE = _positive_int("MQ_WEB_DB_POOL_MAX_SIZE", min(_budget_sync, _DB_POOL_MAX_SIZE))
# Connections of the async pool of each web process, opened as needed: by default its share of
# the budget (2 web processes: 15; 4: 8).
MQ_ASYNC_DB_POOL_MAX_SIZE = _positive_int("MQ_ASYNC_DB_POOL_MAX_SIZE", _budget_async)
# Behind a transaction pooler the processes' connections are the pooler's clients, and
# PostgreSQL sees only its default_pool_size.
if (
    not DATABASES["default"]["ENGINE"].startswith("mqsite.workarounds.sqlite")
    and not MQ_DB_TRANSACTION_POOLER
):
    _web_async = MQ_ASYNC_DB_POOL_MAX_SIZE if MQ_ASYNC_DB else 0
    _rows, _total = db_budget.table(MQ_WEB_PROCESSES, MQ_WEB_DB_POOL_MAX_SIZE, _web_async)
    if _total > MQ_DB_MAX_CONNECTIONS - MQ_DB_RESERVED_CONNECTIONS:
        # Refused at start rather than PostgreSQL refusing connections ("too many clients") under load.
        raise ImproperlyConfigured(
            f"the processes of make run may open {_total} PostgreSQL connections "
            f"({', '.join(f'{n} x {name}: {each}' for name, n, each in _rows)}), more than "
            f"MQ_DB_MAX_CONNECTIONS ({MQ_DB_MAX_CONNECTIONS}) less MQ_DB_RESERVED_CONNECTIONS "
            f"({MQ_DB_RESERVED_CONNECTIONS}): raise PostgreSQL's max_connections and "
            "MQ_DB_MAX_CONNECTIONS with it, lower MQ_WEB_PROCESSES, or the pools' sizes "
            "(docs/operations/index.md, PostgreSQL connections)"
        )

# The channel layer serves the operators' dashboard socket: Redis between processes (services
# mode), in memory in one process (embedded mode). Wake-ups do not use it (mqsite/bus.py).
if REDIS_URL:
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            # channels_redis blocks up to 5 s waiting for a socket's next message; redis-py's
            # default read timeout is also 5 s, so an idle socket's read failed and closed it.
            # redis-py pools 100 connections by default: past ~100 sockets a consumer failed.
            "CONFIG": {
                "hosts": [
                    {
                        "address": REDIS_URL,
                        "socket_timeout": 30,
                        "socket_connect_timeout": 5,
                        "max_connections": 2000,
                    }
                ]
            },
        }
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

if REDIS_URL:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": REDIS_URL}}
else:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}

# --- Auth, i18n, static ---------------------------------------------------------------------
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
# Where `manage.py collectstatic` puts the static files for a proxy to serve (docs/deploy.md).
STATIC_ROOT = Path(env.str("STATIC_ROOT", default=str(VAR_DIR / "static")))
STATIC_ROOT.mkdir(parents=True, exist_ok=True)
# The app ships few static files (admin, API docs); serving them from the finders means a
# fresh checkout serves its pages without a collectstatic step.
WHITENOISE_USE_FINDERS = True

LOGIN_URL = "/admin/login/"

# --- Login lockout (django-axes) ------------------------------------------------------------
# Each admin login attempt runs the password hasher (0.57 s of CPU here), so a flood of them
# slowed every publish of the server five times. After MQ_LOGIN_FAILURE_LIMIT failures from one
# client address, or for one username from anywhere, further attempts are refused (429) before
# the hasher runs, until MQ_LOGIN_COOLOFF_SECS pass without a failure. `manage.py axes_reset`
# lifts every lockout at once.
MQ_LOGIN_FAILURE_LIMIT = _positive_int("MQ_LOGIN_FAILURE_LIMIT", 5)
# How long a locked-out address or user name stays refused.
MQ_LOGIN_COOLOFF_SECS = _positive_int("MQ_LOGIN_COOLOFF_SECS", 900)
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",  # first: it refuses a locked-out attempt
    "django.contrib.auth.backends.ModelBackend",
]
AXES_FAILURE_LIMIT = MQ_LOGIN_FAILURE_LIMIT
AXES_COOLOFF_TIME = timedelta(seconds=MQ_LOGIN_COOLOFF_SECS)
AXES_LOCKOUT_PARAMETERS = ["ip_address", "username"]  # each on its own, not the pair
AXES_CLIENT_IP_CALLABLE = "mqsite.client_address.request_client_address"
AXES_RESET_ON_SUCCESS = True
AXES_VERBOSE = False  # no banner at every process's start; failures are still logged
# The cool-off runs from the lockout: failures during it do not extend it (an attacker could
# otherwise keep an operator out for as long as they like).
AXES_RESET_COOL_OFF_ON_FAILURE_DURING_LOCKOUT = False
AXES_COOLOFF_MESSAGE = (
    f"Too many failed logins from this address or for this user: try again in "
    f"{max(MQ_LOGIN_COOLOFF_SECS // 60, 1)} minutes, or ask an operator to run manage.py axes_reset."
)
# A new token is shown once through a message: keep it in the session, not in a cookie.
MESSAGE_STORAGE = "django.contrib.messages.storage.session.SessionStorage"

# --- HTTPS (production) ---------------------------------------------------------------------
# MQ_HTTPS=true where the server is reached over HTTPS (usually behind a proxy that ends TLS
# and sets X-Forwarded-Proto): secure cookies, http redirected to https, HSTS. Off by default,
# so that `make run` serves plain http on 127.0.0.1. `manage.py check --deploy` is clean with
# it on, SECRET_KEY set and DEBUG off.
MQ_HTTPS = env.bool("MQ_HTTPS", default=False)
# `make run` migrates the database before it serves (manage.py ensuremigrated) only where this
# is on. In production settings (MQ_HTTPS: the server reached over TLS, as docs/deploy.md sets
# it up) it is off by default: migrations are a release step there (`make migrate`, after a
# backup; one may lock a table for minutes), and a database that lacks one is refused. On a
# developer's machine (plain http on 127.0.0.1, either mode) `make run` migrates, as it always did.
MQ_MIGRATE_ON_RUN = env.bool("MQ_MIGRATE_ON_RUN", default=not MQ_HTTPS)
if MQ_HTTPS:
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_SSL_REDIRECT = True
    SECURE_REDIRECT_EXEMPT = [r"^healthz$"]  # a load balancer's health check may speak http
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    # With MQ_HTTPS: how long browsers remember to use https only (HSTS), a year by default.
    SECURE_HSTS_SECONDS = _positive_int("SECURE_HSTS_SECONDS", 31536000)
    # With MQ_HTTPS: HSTS covers the subdomains too.
    SECURE_HSTS_INCLUDE_SUBDOMAINS = env.bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", default=True)
    # The header only allows a submission to the browsers' preload list; nobody is submitted.
    SECURE_HSTS_PRELOAD = env.bool("SECURE_HSTS_PRELOAD", default=True)

# --- The queue's own settings ---------------------------------------------------------------
# The largest payload of a message (its UTF-8 JSON); larger is refused with 413.
MQ_MAX_PAYLOAD_BYTES = _positive_int("MQ_MAX_PAYLOAD_BYTES", 262144)
# A publish body (a batch) is read into memory and parsed whole, and parsed JSON takes up to 30
# times its text (a 14 MiB body took 364 MB and 8.7 s to refuse at the old 32 MiB): 8 MiB holds
# a full batch of 1000 messages of 8 KiB, or 30 at the payload limit. A single message is held
# to its payload's limit and envelope (mqsite/bodies.py), however large this is. Also the
# largest socket frame.
MQ_MAX_BODY_BYTES = _positive_int("MQ_MAX_BODY_BYTES", max(8 * 1024 * 1024, 5 * MQ_MAX_PAYLOAD_BYTES))
# Every other route (acks, nacks, subscriptions, the admin) takes small bodies: an ack of 10,000
# ids is about 200 KB. What a JSON body becomes in memory grows with its size (1 MiB of `[]`
# is 30 MB of lists), so these get a smaller cap, checked before the body is read.
MQ_MAX_SMALL_BODY_BYTES = _positive_int("MQ_MAX_SMALL_BODY_BYTES", 1024 * 1024)
# Deeper JSON than this is refused: parsers and databases recurse on nesting.
MQ_MAX_JSON_DEPTH = _positive_int("MQ_MAX_JSON_DEPTH", 64)
# Deliveries in flight on one websocket at most (a socket may ask for fewer with `prefetch`).
MQ_PREFETCH = _positive_int("MQ_PREFETCH", 100)
# Long polls (GET /api/deliveries with wait > 0) one subscriber may have waiting at once, across
# processes with Redis: each holds a server thread, so one token must not open hundreds.
MQ_MAX_LONG_POLLS = _positive_int("MQ_MAX_LONG_POLLS", 4)
# true: webhook URLs may point at loopback, private or link-local addresses (tests, local demos).
MQ_WEBHOOK_ALLOW_PRIVATE = env.bool("MQ_WEBHOOK_ALLOW_PRIVATE", default=False)
# The deadline of a whole webhook post (connect, headers, body). The contract says 10 s; a
# setting only so that tests against real workers are fast, never longer than the contract.
MQ_WEBHOOK_TIMEOUT_SECS = _positive_float("MQ_WEBHOOK_TIMEOUT_SECS", 10.0)
if MQ_WEBHOOK_TIMEOUT_SECS > 10:
    raise ImproperlyConfigured("MQ_WEBHOOK_TIMEOUT_SECS is at most 10 (the contract's deadline)")
# After a webhook secret is rotated, posts are signed with the old one too (Standard Webhooks
# allows several signatures) for this long, so a receiver can switch to the new secret without
# refusing a delivery. 24 h by default; 0: the old secret stops at once.
MQ_WEBHOOK_SECRET_GRACE_SECS = _whole_number("MQ_WEBHOOK_SECRET_GRACE_SECS", 24 * 3600)
# A webhook whose every attempt has failed for this long, and for at least
# MQ_WEBHOOK_DISABLE_FAILURES attempts in a row, is disabled (delivery.webhook_health): posted
# nothing more, its deliveries kept owed, until an operator enables it again. Both must hold,
# so that neither a burst of failures nor one slow retry a day disables an endpoint.
MQ_WEBHOOK_DISABLE_AFTER_SECS = _whole_number("MQ_WEBHOOK_DISABLE_AFTER_SECS", 5 * 24 * 3600)
# The failed attempts in a row (and no success) a webhook needs, beside the time above, to be
# disabled. Counted per attempt posted: a batch's untried rest counts nothing.
MQ_WEBHOOK_DISABLE_FAILURES = _positive_int("MQ_WEBHOOK_DISABLE_FAILURES", 50)
# Where the Parquet archive of acked history goes (any path Spark can read).
MQ_ARCHIVE_DIR = env.str("MQ_ARCHIVE_DIR", default=str(VAR_DIR / "archive"))
# The archive keeps today's (UTC) partitions and those of this many days before; older (queue,
# day) partitions are deleted whole, on beat after the archive run (`manage.py prunearchive`).
# 0: kept forever. Keep it above every queue's retention_days, or days are archived only to go.
MQ_ARCHIVE_RETENTION_DAYS = _whole_number("MQ_ARCHIVE_RETENTION_DAYS", 0)
# The Spark master the analytics run on: local[*] (this machine), or a cluster's URL.
SPARK_MASTER = env.str("SPARK_MASTER", default="local[*]")
# How long `analyze` waits for the archive's lock (held by the archive, its compaction or
# another analysis) before it gives up with AnalysisBusy.
MQ_ANALYZE_LOCK_WAIT_SECS = _positive_float("MQ_ANALYZE_LOCK_WAIT_SECS", 60.0)
# Past this many deliveries in the hot tables, their hour rows are computed by Spark rather
# than in the analyzing process with Arrow (which holds the snapshot in memory).
MQ_ANALYTICS_HOT_SPARK_ROWS = _positive_int("MQ_ANALYTICS_HOT_SPARK_ROWS", 2_000_000)
# Up to this many bytes of the archive's Parquet to recompute (changed partitions; a whole
# first run included), a run reduces them in its own process with Arrow, a partition at a time
# on every core, rather than start Spark: a JVM's start and first query cost 5-15 s, and Arrow
# reduces the 5 M-delivery archive (183 MB) in about 3 CPU s. Past it, Spark, which splits the
# work by file and scales out to a cluster. 0: always Spark.
MQ_ANALYTICS_LOCAL_BYTES = _whole_number("MQ_ANALYTICS_LOCAL_BYTES", 1 << 30)
# The archive's partitions to recompute go to Spark this many bytes of Parquet at a time (about
# 30 million deliveries a GiB): bounds a first run's memory over a long history.
MQ_ANALYTICS_CHUNK_BYTES = _positive_int("MQ_ANALYTICS_CHUNK_BYTES", 1 << 30)
# A Spark Connect server (sc://host:15002) to run the analytics on; when set, SPARK_MASTER is
# not used (the server has its own master) and no JVM starts here.
SPARK_REMOTE = env.str("SPARK_REMOTE", default="")
if SPARK_REMOTE and not SPARK_REMOTE.startswith("sc://"):
    raise ImproperlyConfigured(
        f"SPARK_REMOTE must be a Spark Connect URL (sc://host:port), not {SPARK_REMOTE!r}"
    )
# The analytics driver's heap when it runs here (a JVM size: 512m, 2g); read when the JVM
# starts, so changing it needs a new worker process.
MQ_SPARK_DRIVER_MEMORY = env.str("MQ_SPARK_DRIVER_MEMORY", default="2g")
if not re.fullmatch(r"[1-9][0-9]*[kmgt]?", MQ_SPARK_DRIVER_MEMORY.lower()):
    raise ImproperlyConfigured(
        f"MQ_SPARK_DRIVER_MEMORY must be a JVM memory size such as 512m or 2g, not {MQ_SPARK_DRIVER_MEMORY!r}"
    )
# A local Spark driver's class archive (AppCDS: its classes load already checked, a second off
# each run's start); made by the first run after an install. Empty: none.
MQ_SPARK_CLASS_ARCHIVE = env.str("MQ_SPARK_CLASS_ARCHIVE", default=str(VAR_DIR / "spark-classes.jsa"))
# Where Spark writes its event logs (for its history server); empty: none.
MQ_SPARK_EVENT_LOG_DIR = env.str("MQ_SPARK_EVENT_LOG_DIR", default="")
# Any Spark setting for the analytics' session, as a JSON object of names to values:
# '{"spark.executor.memory": "4g", "spark.executor.instances": "8", "spark.hadoop.fs.s3a.endpoint":
# "https://s3.example.net", "spark.kubernetes.container.image": "registry/spark-py:4.3.0"}'. JSON
# because values hold commas and spaces (spark.jars.packages, extraJavaOptions). Applied last,
# over this project's own defaults; not on a Spark Connect server, which has its own.
MQ_SPARK_CONF = _spark_conf("MQ_SPARK_CONF", "{}")
# The analytics run on beat this often (CELERY_BEAT_SCHEDULE["analyze"]: operators change it in
# the admin afterwards, and their change is kept).
MQ_ANALYZE_EVERY_SECS = _positive_float("MQ_ANALYZE_EVERY_SECS", 3600.0)
# REST requests one subscriber (or operator, or anonymous address) may make: N per window
# ("30/s", "1800/min", "3000/10s"), counted in fixed windows; beyond, 429 with Retry-After.
# 3000 in 10 s: 300 a second sustained, in bursts of up to 3000. Above what one prompt consumer
# of an ordered queue needs over REST (a pull and an ack a message, at 100 messages a second
# and more), below what a runaway loop on several connections takes from a server; a real service
# batches (up to 1000 messages a publish), long-polls and acks in sets, or uses the websocket
# (which has limits of its own). The old 2000 a second was no limit. A deployment that wants a
# tighter bound per tenant lowers it.
MQ_THROTTLE_RATE = env.str("MQ_THROTTLE_RATE", default="3000/10s")
try:
    parse_rate(MQ_THROTTLE_RATE)
except ValueError as exc:
    raise ImproperlyConfigured(f"MQ_THROTTLE_RATE: {exc}") from None
# Proxies (addresses or networks, comma-separated: 10.0.0.1,192.168.0.0/16) whose
# X-Forwarded-For is believed (mqsite/client_address.py): the client's address, which every
# throttle and the login lockout count by, is then the one the outermost of them saw. Empty by
# default: the connection's peer, since a client can send the header with any address it likes.
MQ_TRUSTED_PROXIES = env.list("MQ_TRUSTED_PROXIES", default=[])
for _proxy in MQ_TRUSTED_PROXIES:
    try:
        ipaddress.ip_network(_proxy, strict=False)
    except ValueError:
        raise ImproperlyConfigured(
            f"MQ_TRUSTED_PROXIES holds {_proxy!r}, which is not an address or a network"
        ) from None
# Failed token attempts (REST and websocket) per client address per minute; beyond it a bad
# token is answered 429 (a socket: 4429), so a scanner costs little and is told to back off.
MQ_AUTH_FAILURES_PER_MINUTE = _positive_int("MQ_AUTH_FAILURES_PER_MINUTE", 30)
# How often each server process checks (one query) that its sockets' tokens still hold: the
# bound on revocation when the announcement over Redis is lost (it must stay under 2 s).
MQ_REVOCATION_CHECK_SECS = _positive_float("MQ_REVOCATION_CHECK_SECS", 0.5)
# What one subscriber may take of the shared server (mqsite/limits.py): frames per second on a
# socket and the burst it may send at once (a flood of frames was a query each); how long a
# socket may stay over that before it is closed; and caps on its open sockets (each a row and
# a heartbeat), subscriptions (each fanned out to), event names made per hour (each a row
# and a /metrics label forever) and receipts its sockets in a process wait for at once (each
# probed by that process's recheck every 2 s: a cap per socket let 64 sockets wait for 640,000).
MQ_WS_FRAME_RATE = _positive_int("MQ_WS_FRAME_RATE", 5000)
# Frames one socket may send at once before the rate applies.
MQ_WS_FRAME_BURST = _positive_int("MQ_WS_FRAME_BURST", 10000)
# A socket refused frames this long on end (no 1 s pause) is closed with 4429.
MQ_WS_ABUSE_SECS = _positive_float("MQ_WS_ABUSE_SECS", 5.0)
# The largest frame a socket may send before it is authenticated (an `auth` frame: a token and
# a prefetch); a bigger one closes it (4413) undecoded, so that no token buys no decoding.
MQ_WS_AUTH_FRAME_BYTES = _positive_int("MQ_WS_AUTH_FRAME_BYTES", 4096)
# Sockets one client address may hold open, in each server process, before sending their `auth`
# frame (each is held up to 10 s for nothing at stake); one past it is closed with 4429.
MQ_WS_MAX_UNAUTHENTICATED_PER_ADDRESS = _positive_int("MQ_WS_MAX_UNAUTHENTICATED_PER_ADDRESS", 64)
# The whole time an HTTP client has to send a request's headers (from the connection, or the end
# of its last answer, to the blank line): a client dripping a byte at a time is cut off after it
# (Twisted's idle timeout of 60 s started again at every byte). Also how long a kept-alive
# connection may stay idle (mqsite/workarounds/daphne_headers.py).
MQ_HTTP_HEADER_TIMEOUT_SECS = _positive_float("MQ_HTTP_HEADER_TIMEOUT_SECS", 10.0)
# Open sockets per subscriber; the next gets `too_many_connections` and the close 4429.
MQ_MAX_CONNECTIONS_PER_SUBSCRIBER = _positive_int("MQ_MAX_CONNECTIONS_PER_SUBSCRIBER", 64)
# Subscriptions per subscriber; a new one beyond is 409 (`too_many_subscriptions`).
MQ_MAX_SUBSCRIPTIONS_PER_SUBSCRIBER = _positive_int("MQ_MAX_SUBSCRIPTIONS_PER_SUBSCRIBER", 256)
# Event names a subscriber may make an hour; beyond, 429 (`too_many_new_events`). Operators: no cap.
MQ_MAX_NEW_EVENTS_PER_SUBSCRIBER = _positive_int("MQ_MAX_NEW_EVENTS_PER_SUBSCRIBER", 100)
# Replays (subscribe with "from", seek) and unsubscribes touch a row per message of the hot
# tables: they go in chunks of MQ_REPLAY_CHUNK rows (1000), each its own short transaction, so
# other writers (SQLite has one at a time) get through between chunks; and a subscriber may
# have MQ_MAX_REPLAYS_PER_SUBSCRIBER (1) replays under way at once, beyond which it is answered
# 429 with Retry-After (a loop of replays queues no unbounded work).
MQ_REPLAY_CHUNK = _positive_int("MQ_REPLAY_CHUNK", 1000)
# Replays one subscriber may have under way at once; beyond, 429 (`too_many_replays`).
MQ_MAX_REPLAYS_PER_SUBSCRIBER = _positive_int("MQ_MAX_REPLAYS_PER_SUBSCRIBER", 1)
# A replay or an unsubscribe whose last chunk ran MQ_REPLAY_STALL_SECS ago (30) stopped halfway
# (its server died): the sweep finishes it. Until then the subscription is leased nothing.
MQ_REPLAY_STALL_SECS = _positive_float("MQ_REPLAY_STALL_SECS", 30.0)
# Receipts (publish frames with "receipt": true) a subscriber's sockets in one web process may
# await at once: each is a row of the registry and of the 2 s recheck's query.
MQ_MAX_RECEIPTS_PER_SUBSCRIBER = _positive_int("MQ_MAX_RECEIPTS_PER_SUBSCRIBER", 10000)
# Retry backoff: the first retry after BASE seconds, doubling, never more than MAX seconds.
MQ_BACKOFF_BASE_SECS = env.float("MQ_BACKOFF_BASE_SECS", default=1.0)
# The longest wait between two attempts.
MQ_BACKOFF_MAX_SECS = env.float("MQ_BACKOFF_MAX_SECS", default=300.0)
# /metrics names every subscriber and its backlog: it answers a scraper that sends this as a
# bearer token, or a staff session; MQ_METRICS_PUBLIC=true opens it to anyone (a network only
# Prometheus reaches).
MQ_METRICS_TOKEN = env.str("MQ_METRICS_TOKEN", default="")
# true: /metrics answers anyone.
MQ_METRICS_PUBLIC = env.bool("MQ_METRICS_PUBLIC", default=False)
# A scrape is answered from a snapshot at most this old, shared by every process through the
# cache: a loop of scrapes costs the database one computation per this many seconds.
MQ_METRICS_MAX_AGE_SECS = env.float("MQ_METRICS_MAX_AGE_SECS", default=5.0)
if MQ_METRICS_MAX_AGE_SECS < 0:
    raise ImproperlyConfigured(f"MQ_METRICS_MAX_AGE_SECS must be 0 or more, not {MQ_METRICS_MAX_AGE_SECS}")
# A folder where every serving process of this machine keeps its latency histograms, for
# /metrics to add up (prometheus-client's multiprocess mode, read by it from the environment;
# mqsite/prometheus.py says why). `make run` sets it to RUN_DIR/metrics and empties it at each
# start; elsewhere, empty it before the processes start. Unset: each process counts alone.
PROMETHEUS_MULTIPROC_DIR = env.str("PROMETHEUS_MULTIPROC_DIR", default="")
if PROMETHEUS_MULTIPROC_DIR and not os.access(PROMETHEUS_MULTIPROC_DIR, os.W_OK | os.X_OK):
    raise ImproperlyConfigured(
        f"PROMETHEUS_MULTIPROC_DIR must name a writable folder, not {PROMETHEUS_MULTIPROC_DIR!r}"
    )

# --- Tracing --------------------------------------------------------------------------------------
# OpenTelemetry's own variables, read by its SDK (docs/tracing.md): tracing is on when
# OTEL_TRACES_EXPORTER names an exporter or an OTLP endpoint is set (mqsite.tracing.wanted).
OTEL_ENVIRON = {name: value for name, value in os.environ.items() if name.startswith("OTEL_")}

# --- Celery -------------------------------------------------------------------------------------
if REDIS_URL:
    CELERY_BROKER_URL = REDIS_URL
    # A job is redelivered this long after a worker took it without acking it (acks_late): far
    # longer than a job runs (CELERY_TASK_TIME_LIMIT), so a slow job is never run twice at
    # once; a job lost for good is found again by the sweeper long before this.
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "visibility_timeout": 900,
        "socket_timeout": 5,
        "socket_connect_timeout": 2,
    }
else:
    # Embedded mode: jobs are files in a folder, so the worker needs no broker service.
    # MQ_CELERY_DIR: another folder, for a second server on one machine (the fault tests).
    CELERY_QUEUE_DIR = Path(env.str("MQ_CELERY_DIR", default=str(VAR_DIR / "celery")))
    for sub in ("queue", "processed", "control"):
        (CELERY_QUEUE_DIR / sub).mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_URL = "filesystem://"
    # kombu's own, but a job is written whole before a worker can see it (the module says why)
    CELERY_BROKER_TRANSPORT = "mqsite.workarounds.kombu_files:Transport"
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(CELERY_QUEUE_DIR / "queue"),
        "data_folder_out": str(CELERY_QUEUE_DIR / "queue"),
        "processed_folder": str(CELERY_QUEUE_DIR / "processed"),
        "control_folder": str(CELERY_QUEUE_DIR / "control"),
        "store_processed": False,
        "polling_interval": 0.2,
    }
# An enqueue inside a request gives up quickly when the broker is down: the job is a hint
# (the sweeper finds the due work in the database), the publish must not wait on it.
CELERY_TASK_PUBLISH_RETRY_POLICY = {
    "max_retries": 1,
    "interval_start": 0,
    "interval_step": 0.2,
    "interval_max": 0.2,
}
CELERY_TASK_ACKS_LATE = True  # a job a killed worker held is run again (jobs are idempotent)
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_TIME_LIMIT = 300
CELERY_TASK_SOFT_TIME_LIMIT = 240
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BEAT_SCHEDULER = "mqsite.beat:OperatorEditableScheduler"
# Posts on a queue of their own, the sweeper and the archive on another, the analytics on a
# third, each served by a worker of its own (mqsite/supervisord.conf): a worker busy posting to
# slow endpoints, or a Spark run of minutes, never holds up a sweep. Anything else goes to the
# default queue, which the maintenance worker serves.
CELERY_TASK_ROUTES = {
    "delivery.tasks.deliver_webhooks": {"queue": "webhooks"},
    "delivery.tasks.sweep": {"queue": "maintenance"},
    "analytics.tasks.archive_history": {"queue": "maintenance"},
    "analytics.tasks.analyze": {"queue": "analytics"},
}
CELERY_BEAT_SCHEDULE = {
    # Every second: retries are due by the second (backoff starts at 1 s).
    "sweep": {"task": "delivery.tasks.sweep", "schedule": 1.0},
    # Hourly: retention is counted in days, and each run moves whatever has passed it since.
    "archive": {"task": "analytics.tasks.archive_history", "schedule": 3600.0},
    # The statistics of the admin, the dashboard's History, /metrics and GET /api/analytics.
    "analyze": {"task": "analytics.tasks.analyze", "schedule": MQ_ANALYZE_EVERY_SECS},
}

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "subscribers.auth.BearerTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["subscribers.auth.IsSubscriberOrOperator"],
    "DEFAULT_PARSER_CLASSES": ["mqsite.parsers.BoundedJSONParser", "mqsite.parsers.AnyTypeJSONParser"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_THROTTLE_CLASSES": ["subscribers.throttling.ClientRateThrottle"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "mqsite.errors.api_exception_handler",
    "UNAUTHENTICATED_USER": None,
}

SPECTACULAR_SETTINGS = {
    "TITLE": "mqsite queue server",
    "DESCRIPTION": "Publish, subscribe, pull and acknowledge messages. The manual: docs/rest-api.md.",
    "VERSION": VERSION,  # mqsite/version.py: one version for the server, the schemas, the clients
    "SERVE_INCLUDE_SCHEMA": False,
    "SERVE_PERMISSIONS": ["rest_framework.permissions.AllowAny"],
    "SERVE_AUTHENTICATION": [],
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    "PARSER_WHITELIST": ["mqsite.parsers.BoundedJSONParser"],
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "mqsite.api.schema_says_what_the_server_refuses",
    ],
}

# How every process logs (mqsite.log_context): `text`, a line of time, level, logger and words,
# or `json`, one JSON object a line with the ids of the request, subscriber, message and
# delivery it is about. Either way a token or a webhook secret in a line is blanked.
MQ_LOG_FORMAT = env.str("MQ_LOG_FORMAT", default="text")
# /healthz answers 503 when no worker is alive or the sweep is late: where workers run beside
# the web (`make run`, a deployment). Off for a web process that runs alone on purpose.
MQ_HEALTH_WORKERS = env.bool("MQ_HEALTH_WORKERS", default=True)
# How long since the sweep (every second) last ran before /healthz says it is late.
MQ_HEALTH_SWEEP_SECS = _positive_float("MQ_HEALTH_SWEEP_SECS", 30.0)
LOGGING_CONFIG = "mqsite.log_context.configure"
if MQ_LOG_FORMAT not in ("text", "json"):
    raise ImproperlyConfigured(f"MQ_LOG_FORMAT must be text or json, not {MQ_LOG_FORMAT!r}")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {
        "context": {"()": "mqsite.log_context.Context"},
        "redact": {"()": "mqsite.log_context.Redact"},
    },
    "formatters": {
        "text": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"},
        "json": {
            "()": "mqsite.log_context.JsonFormatter",
            "fmt": "%(levelname)s %(name)s %(message)s",
            "rename_fields": {"levelname": "level", "name": "logger"},
            "timestamp": "time",
        },
    },
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": MQ_LOG_FORMAT,
            "filters": ["context", "redact"],
        }
    },
    # The level of what the processes log (DEBUG, INFO, WARNING, ERROR).
    "root": {"handlers": ["console"], "level": env.str("LOG_LEVEL", default="INFO")},
    "loggers": {"django.db.backends": {"level": "INFO"}, "httpx": {"level": "WARNING"}},
}
