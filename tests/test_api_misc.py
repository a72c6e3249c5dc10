"""/healthz, /api/schema/, /api/docs/, throttling, and errors that stay JSON."""

import re

from django.core.cache import cache
from django.test import override_settings

from tests.conftest import client_for


def test_healthz_is_public_and_says_ok(db):
    r = client_for().get("/healthz")
    assert r.status_code == 200
    assert r.json()["status"] == "ok" and r.json()["database"] == "ok"


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


def test_the_docs_page_serves_its_own_assets(db):
    r = client_for().get("/api/docs/")
    assert r.status_code == 200
    html = r.content.decode()
    assets = re.findall(r'(?:src|href)="(/static/[^"]+)"', html)
    assert assets, "the docs page should load its assets from this server"
    assert "cdn" not in html.lower()
    for asset in assets:
        assert client_for().get(asset).status_code == 200, asset


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


@override_settings(MQ_THROTTLE_RATE="1/min")
def test_the_throttle_counts_in_redis_and_lets_calls_through_when_redis_is_down(logger, settings):
    from subscribers import throttling

    try:
        settings.CACHES = {
            "default": {
                "BACKEND": "django.core.cache.backends.redis.RedisCache",
                "LOCATION": "redis://127.0.0.1:6379/3",
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
        settings.CACHES["default"]["LOCATION"] = "redis://127.0.0.1:6379/3"
        throttling.counters.cache_clear()
        throttling.counters().clear()
        throttling.counters.cache_clear()


def test_healthz_is_503_when_what_carries_the_jobs_is_down(db, settings):
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there
    r = client_for().get("/healthz")
    assert r.status_code == 503
    assert r.json()["database"] == "ok" and r.json()["jobs"].startswith("unavailable")


def test_healthz_checks_redis_in_the_services_mode(db, settings):
    settings.REDIS_URL = "redis://127.0.0.1:6379/0"
    r = client_for().get("/healthz")
    assert r.status_code == 200 and r.json()["mode"] == "services" and r.json()["jobs"] == "ok"
