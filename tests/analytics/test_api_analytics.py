"""GET /api/analytics: the operators' view of the last analytics run, from the stored results
(tests/support/run_folders.py writes the runs, analytics.load loads them)."""

from datetime import UTC, datetime, timedelta

import pytest

from analytics import load, stored
from tests.conftest import client_for
from tests.support.run_folders import write_run

pytestmark = pytest.mark.django_db

URL = "/api/analytics"
HOUR = datetime(2026, 11, 24, 22, tzinfo=UTC)


@pytest.fixture
def loaded(tmp_path):
    """A run of two events and two subscribers, with trends over three hours and two days."""
    out = str(tmp_path)
    hours = [HOUR + timedelta(hours=i) for i in range(3)]  # 22:00, 23:00, 00:00 the next day
    event_trends = [
        {"queue": q, "event": e, "period_start": h, "messages": n, "deliveries": 2 * n, "acked": n, "dead": 1}
        for q, e in (("db", "create"), ("network", "error"))
        for n, h in enumerate(hours, start=1)
    ] + [
        {"queue": "db", "event": "create", "period": "day", "period_start": d, "messages": 7}
        for d in (datetime(2026, 11, 24, tzinfo=UTC), datetime(2026, 11, 25, tzinfo=UTC))
    ]
    subscriber_trends = [
        {"subscriber": s, "period_start": h, "published": 3, "acked": 2, "backlog": 1}
        for s in ("logger", "monitor")
        for h in hours
    ]
    run_id = write_run(
        out,
        events=[
            {"queue": "db", "event": "create", "messages": 6, "deliveries": 12, "latency_p50_ms": 12.5},
            {"queue": "network", "event": "error", "messages": 6},
        ],
        subscribers=[{"subscriber": "logger", "pending": 1, "inflight": 2, "oldest_pending_age_s": 9.0}],
        event_trends=event_trends,
        subscriber_trends=subscriber_trends,
    )
    load.load_run(out, run_id)
    return run_id


def test_an_operator_sees_the_last_run_and_its_statistics(operator_client, loaded):
    answer = operator_client.get(URL)
    assert answer.status_code == 200
    body = answer.json()
    # The run's manifest, and the statistics exactly as `analyze --json` prints them
    assert body["run"]["run_id"] == loaded
    assert body["run"]["partitions"] == {"total": 10, "recomputed": 2, "reused": 8}
    assert {k: v for k, v in body.items() if k not in ("run", "failures", "windows")} == stored.results_json()
    # ... how old its figures are, and that no run failed since
    assert body["run"]["age_s"] > 0
    assert body["failures"] == {"since_run": 0, "last": None}
    assert [e["event"] for e in body["events"]] == ["create", "error"]
    assert body["subscribers"][0]["backlog"] == 3 and "trends" not in body


def test_before_any_run_the_run_is_null(operator_client):
    assert operator_client.get(URL).json() == {
        "run": None,
        "failures": {"since_run": 0, "last": None},
        "events": [],
        "subscribers": [],
        "windows": {},
    }


def test_subscribers_and_strangers_are_refused(logger, loaded):
    assert client_for(logger).get(URL).status_code == 403
    assert client_for().get(URL).status_code == 401


def test_trends_by_hour_and_by_day(operator_client, loaded):
    hourly = operator_client.get(URL, {"trends": "hour"}).json()["trends"]
    assert hourly["period"] == "hour" and not hourly["truncated"]
    assert len(hourly["events"]) == 6 and len(hourly["subscribers"]) == 6
    first = hourly["events"][0]
    assert (first["queue"], first["event"], first["messages"], first["deliveries"]) == ("db", "create", 1, 2)
    assert datetime.fromisoformat(first["period_start"]) == HOUR
    assert first["latency_ms"] == {"p50": None, "p95": None, "p99": None}
    daily = operator_client.get(URL, {"trends": "day"}).json()["trends"]
    assert [e["messages"] for e in daily["events"]] == [7, 7] and daily["subscribers"] == []


def test_trend_filters_narrow_what_they_name(operator_client, loaded):
    def trends(**query):
        answer = operator_client.get(URL, {"trends": "hour", **query})
        assert answer.status_code == 200, answer.content
        return answer.json()["trends"]

    got = trends(queue="network")
    assert {e["queue"] for e in got["events"]} == {"network"} and len(got["events"]) == 3
    got = trends(queue="DB", event="create")  # names are case-insensitive, as everywhere
    assert {(e["queue"], e["event"]) for e in got["events"]} == {("db", "create")}
    assert {s["subscriber"] for s in trends(subscriber="monitor")["subscribers"]} == {"monitor"}
    # since is inclusive, until exclusive; a date is its midnight UTC
    got = trends(since="2026-11-24T23:00:00Z", until="2026-11-25")
    assert {datetime.fromisoformat(e["period_start"]) for e in got["events"]} == {HOUR + timedelta(hours=1)}
    got = trends(since="2026-11-25")
    assert {datetime.fromisoformat(s["period_start"]) for s in got["subscribers"]} == {
        HOUR + timedelta(hours=2)
    }
    assert trends(queue="nosuchqueue")["events"] == []


@pytest.mark.parametrize(
    "query, field",
    [
        ({"trends": "week"}, "trends"),
        ({"trends": ""}, "trends"),
        ({"trends": "hour", "since": "yesterday"}, "since"),
        ({"trends": "hour", "until": "2026-02-30"}, "until"),
        ({"trends": "hour", "since": "2026-11-25", "until": "2026-11-24"}, "until"),
        ({"trends": "hour", "queue": "no spaces"}, "queue"),
        ({"trends": "hour", "subscriber": "x" * 101}, "subscriber"),
        ({"queue": "db"}, "queue"),  # a filter without trends filters nothing: said, not ignored
    ],
)
def test_a_bad_query_is_a_400_naming_the_field(operator_client, loaded, query, field):
    answer = operator_client.get(URL, query)
    assert answer.status_code == 400 and field in answer.json(), answer.content


def test_the_schema_documents_it(operator_client):
    schema = operator_client.get("/api/schema/", {"format": "json"}).json()
    operation = schema["paths"]["/api/analytics"]["get"]
    assert {p["name"] for p in operation["parameters"]} >= {
        "trends",
        "queue",
        "event",
        "subscriber",
        "since",
        "until",
    }
    assert {"200", "400", "401", "403"} <= set(operation["responses"])
