"""/healthz, /api/schema/, /api/docs/, throttling, and errors that stay JSON."""

import re
import sqlite3
import statistics
import time
from pathlib import Path

import httpx
import psycopg
import pytest
from django.core.cache import cache
from django.test import override_settings

from tests.conftest import client_for
from tests.support.servers import redis_db, start_daphne


def test_healthz_is_public_and_says_ok(db, settings):
    settings.MQ_HEALTH_WORKERS = False  # a web process alone (tests/e2e/test_health.py: with workers)
    r = client_for().get("/healthz")
    assert r.status_code == 200
    assert r.json()["status"] == "ok" and r.json()["database"] == "ok"
    checks = r.json()["checks"]
    assert checks["database"] == checks["broker"] == "ok"
    assert checks["worker"] == {"alive": 0} and checks["sweep"] == {"last_run_s": None}


@pytest.mark.django_db(transaction=True)
def test_the_schema_is_built_once_per_process(capsys):
    """S5: it was built again at every call (every view and serializer inspected), a cost
    anyone could make the server pay in a loop without a token."""
    web = start_daphne()
    try:
        took, bodies = [], []
        for query in ["", "", "?format=yaml", "?version=9&lang=fr", "", ""]:
            started = time.monotonic()
            r = httpx.get(f"{web.http}/api/schema/{query}", timeout=30)
            took.append(time.monotonic() - started)
            assert r.status_code == 200
            bodies.append(r.content)
        assert bodies[0] == bodies[1] == bodies[3] and b"openapi: 3" in bodies[2]
        assert Path(web.log.name).read_text().count("built the API schema") == 1
        with capsys.disabled():
            then = statistics.median(took[1:])
            print(f"\n/api/schema/: first {took[0] * 1000:.0f} ms, then {then * 1000:.0f} ms")
    finally:
        web.stop()


def test_the_schema_is_public_openapi_3_and_names_every_call(db):
    r = client_for().get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert r.status_code == 200
    schema = r.json()
    assert schema["openapi"].startswith("3.")
    for path in (
        "/api/queues",
        "/api/queues/{queue}/messages",
        "/api/subscriptions",
        "/api/subscriptions/{id}",
        "/api/deliveries",
        "/api/deliveries/ack",
        "/api/deliveries/{id}/nack",
    ):
        assert path in schema["paths"], path


def test_an_accept_header_naming_no_json_is_a_406_the_schema_tells_of(logger):
    """Found by Schemathesis: any call may ask for a type the API does not answer in."""
    r = client_for(logger).get("/api/subscriptions", HTTP_ACCEPT='m0w#yS"')
    assert r.status_code == 406 and "Accept" in r.json()["detail"]
    schema = client_for().get("/api/schema/?format=json").json()
    assert "406" in schema["paths"]["/api/subscriptions"]["get"]["responses"]
    assert "406" in schema["paths"]["/api/deliveries/ack"]["post"]["responses"]


def test_the_schema_is_json_unless_yaml_is_asked_for(db):
    r = client_for().get("/api/schema/")
    assert r.status_code == 200 and r.json()["openapi"].startswith("3.")
    r = client_for().get("/api/schema/?format=yaml")
    assert r.status_code == 200 and r.content.startswith(b"openapi: 3.")


def test_the_docs_page_serves_its_own_assets(db):
    r = client_for().get("/api/docs/")
    assert r.status_code == 200
    html = r.content.decode()
    assets = re.findall(r'(?:src|href)="(/static/[^"]+)"', html)
    assert assets, "the docs page should load its assets from this server"
    assert "cdn" not in html.lower()
    for asset in assets:
        assert client_for().get(asset).status_code == 200, asset


@pytest.mark.django_db(transaction=True)
def test_a_publish_while_the_database_is_away_is_a_503_to_retry_and_leaves_nothing(logger):
    """PostgreSQL: the server ends our session (a restart, a failover). SQLite: another writer
    holds the lock past the busy timeout. Either way 503 with Retry-After, never a 500."""
    from django.db import connection

    from queues.models import Message

    client = client_for(logger)
    body = {"event": "create", "payload": {"n": 1}}
    if connection.vendor == "postgresql":
        connection.ensure_connection()
        pid = connection.connection.info.backend_pid
        with psycopg.connect(_admin_url(connection), autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", [pid])
        r = client.post("/api/queues/db/messages", body, format="json")
        connection.close()  # as the end of a request does with a broken connection
    else:
        other = sqlite3.connect(connection.settings_dict["NAME"], isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        try:
            with connection.cursor() as cursor:
                cursor.execute("PRAGMA busy_timeout = 50")
            r = client.post("/api/queues/db/messages", body, format="json")
        finally:
            other.execute("ROLLBACK")
            other.close()
            connection.close()  # the next connection gets the configured timeout back
    assert r.status_code == 503, r.content
    assert r["Retry-After"] == "1" and "try again" in r.json()["detail"].lower()
    assert Message.objects.count() == 0
    r = client_for(logger).post("/api/queues/db/messages", body, format="json")
    assert r.status_code == 201  # and once it is back, the same call goes through


def _admin_url(connection):
    s = connection.settings_dict
    return f"host={s['HOST'] or '127.0.0.1'} port={s['PORT'] or 5432} user={s['USER']} dbname={s['NAME']}"


def test_an_unknown_api_path_is_a_json_404(db):
    r = client_for().get("/api/nothing-here")
    assert r.status_code == 404
    assert r.json()["detail"]


@override_settings(MQ_THROTTLE_RATE="3/min")
def test_a_subscriber_over_its_rate_gets_429(logger):
    cache.clear()
    responses = [client_for(logger).get("/api/queues") for _ in range(5)]
    assert [r.status_code for r in responses] == [200, 200, 200, 429, 429]
    assert "throttled" in responses[-1].json()["detail"].lower()
    assert 0 < int(responses[-1]["Retry-After"]) <= 60
    cache.clear()


def test_the_throttle_counts_in_redis_and_lets_calls_through_when_redis_is_down(logger, settings):
    from subscribers import throttling

    settings.MQ_THROTTLE_RATE = "1/min"  # (not override_settings: stacked with `settings`, it leaks)
    try:
        settings.CACHES = {
            "default": {
                "BACKEND": "django.core.cache.backends.redis.RedisCache",
                "LOCATION": redis_db(3),
            }
        }
        throttling.counters.cache_clear()
        throttling.counters().clear()
        codes = [client_for(logger).get("/api/queues").status_code for _ in range(2)]
        assert codes == [200, 429]  # counted in the machine's Redis, one process-wide client

        settings.CACHES["default"]["LOCATION"] = "redis://127.0.0.1:1/0"  # nothing listens there
        throttling.counters.cache_clear()
        codes = [client_for(logger).get("/api/queues").status_code for _ in range(3)]
        assert codes == [200, 200, 200]  # a Redis outage must not become an API outage
    finally:
        settings.CACHES["default"]["LOCATION"] = redis_db(3)
        throttling.counters.cache_clear()
        throttling.counters().clear()
        throttling.counters.cache_clear()


def test_healthz_is_503_when_what_carries_the_jobs_is_down(db, settings):
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there
    r = client_for().get("/healthz")
    assert r.status_code == 503
    assert r.json()["database"] == "ok" and r.json()["jobs"].startswith("unavailable")


def test_healthz_checks_redis_in_the_services_mode(db, settings):
    settings.REDIS_URL = redis_db(0)
    settings.MQ_HEALTH_WORKERS = False  # the broker's check only (tests/e2e/test_health.py: workers)
    r = client_for().get("/healthz")
    assert r.status_code == 200 and r.json()["mode"] == "services" and r.json()["jobs"] == "ok"
