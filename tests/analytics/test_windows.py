"""What operators read during an incident: the last hour's and the last 24 hours' figures, and
each subscriber's latency, in `analyze --json`, GET /api/analytics and /metrics, after a real
run over the database and the archive, checked against the rows in plain Python."""

import io
import json
from datetime import timedelta

import pytest
from django.core.cache import cache
from django.core.management import call_command
from django.utils import timezone

from analytics import archive, windows
from delivery import subscribing
from delivery.models import Delivery, Status
from queues.models import Message
from tests.analytics.history import within_rank
from tests.dashboard.test_metrics import BEARER, parse_metrics
from tests.support.history_rows import publish_at, settle

pytestmark = pytest.mark.django_db

# Minutes before the run: in the last hour, in the last 24 hours only, and older than both.
RECENT, EARLIER, OLD = (5, 20, 35, 50), (4 * 60, 10 * 60), (30 * 60, 50 * 60)


@pytest.fixture
def incident(spark, archive_dir, db_queue, logger, peer, settings):
    """db/create published over two days; the logger acks in tens of ms, the peer in seconds,
    and in the last hour a message died at the peer. Settled history archived, the rest hot."""
    settings.MQ_METRICS_TOKEN = BEARER["HTTP_AUTHORIZATION"].split()[1]
    subscribing.subscribe(logger, db_queue)
    subscribing.subscribe(peer, db_queue)
    now = timezone.now()
    for i, minutes in enumerate(sorted(RECENT + EARLIER + OLD, reverse=True)):
        for n in range(3):
            at = now - timedelta(minutes=minutes, seconds=n)
            message = publish_at(db_queue, "create", at)
            settle(message, {logger: Status.ACKED}, latency_ms=10 + 3 * i + n)
            peer_fate = Status.DEAD if (minutes, n) == (RECENT[0], 0) else Status.ACKED
            settle(message, {peer: peer_fate}, latency_ms=2000 + 100 * i + 7 * n)
    expected = expectations(now)
    archive.archive_history(older_than_days=0)  # all but the dead letter's message
    assert Message.objects.count() == 1
    out = io.StringIO()
    call_command("analyze", "--json", stdout=out, stderr=io.StringIO())
    cache.clear()
    return json.loads(out.getvalue()), expected


def expectations(now):
    """{window: (messages, deliveries, dead, {subscriber: latencies}, all latencies)} from the
    rows before they were archived."""
    out = {}
    for name, span in (*windows.WINDOWS.items(), ("all", None)):
        since = windows.start_of(now, span) if span else None
        messages = Message.objects.filter(created_at__gte=since) if since else Message.objects.all()
        deliveries = list(
            Delivery.objects.filter(message__in=messages).values(
                "subscriber__name", "status", "created_at", "acked_at"
            )
        )
        latencies = {}
        for d in deliveries:
            if d["status"] == Status.ACKED:
                ms = (d["acked_at"] - d["created_at"]) / timedelta(milliseconds=1)
                latencies.setdefault(d["subscriber__name"], []).append(ms)
        out[name] = (
            messages.count(),
            len(deliveries),
            sum(d["status"] == Status.DEAD for d in deliveries),
            {s: sorted(v) for s, v in latencies.items()},
            sorted(v for vs in latencies.values() for v in vs),
        )
    return out


def test_analyze_json_gives_each_subscribers_latency(incident):
    printed, expected = incident
    by_name = {s["subscriber"]: s for s in printed["subscribers"]}
    for name, latencies in expected["all"][3].items():
        got = by_name[name]["latency_ms"]
        for q in ("p50", "p95", "p99"):
            assert within_rank(latencies, float("0." + q[1:]), got[q]), (name, q)
    # Which consumer is slow: the peer, by two orders of magnitude
    assert by_name["peer"]["latency_ms"]["p50"] > 50 * by_name["logger"]["latency_ms"]["p50"]


def test_the_api_answers_the_last_hour_and_the_last_24_hours(incident, operator_client):
    body = operator_client.get("/api/analytics").json()
    run_now = body["run"]["now"]
    assert set(body["windows"]) == {"1h", "24h"}
    for name in ("1h", "24h"):
        window = body["windows"][name]
        messages, deliveries, dead, by_subscriber, latencies = incident[1][name]
        assert window["until"] == run_now
        assert window["since"] <= run_now
        [event] = window["events"]
        assert (event["queue"], event["event"]) == ("db", "create")
        assert (event["messages"], event["deliveries"], event["dead"]) == (messages, deliveries, dead), name
        assert event["acked"] == len(latencies)
        assert event["dead_letter_rate"] == pytest.approx(dead / deliveries)
        for q in ("p50", "p95", "p99"):
            assert within_rank(latencies, float("0." + q[1:]), event["latency_ms"][q]), (name, q)
        subscribers = {s["subscriber"]: s for s in window["subscribers"]}
        assert subscribers.keys() == by_subscriber.keys()
        for subscriber, values in by_subscriber.items():
            assert subscribers[subscriber]["acked"] == len(values)
            assert within_rank(values, 0.99, subscribers[subscriber]["latency_ms"]["p99"]), (name, subscriber)
    # The windows differ from each other and from the whole history: an incident moves them
    counts = [body["windows"][w]["events"][0]["messages"] for w in ("1h", "24h")]
    assert counts == [3 * len(RECENT), 3 * (len(RECENT) + len(EARLIER))]
    assert body["events"][0]["messages"] == 3 * (len(RECENT) + len(EARLIER) + len(OLD))
    assert body["windows"]["1h"]["events"][0]["dead"] == 1


def test_metrics_label_the_windows(incident, client):
    samples = parse_metrics(client.get("/metrics", **BEARER).content.decode())

    def gauge(name, **labels):
        return samples.get((name, tuple(sorted(labels.items()))))

    expected = incident[1]
    for name in ("1h", "24h", "all"):
        messages, deliveries, dead, by_subscriber, latencies = expected[name]
        labels = {"window": name, "queue": "db", "event": "create"}
        assert gauge("mq_analytics_window_messages", **labels) == messages
        assert gauge("mq_analytics_window_deliveries", **labels) == deliveries
        assert gauge("mq_analytics_window_dead_letters", **labels) == dead
        p99 = gauge("mq_analytics_window_latency_seconds", quantile="0.99", **labels)
        assert within_rank(latencies, 0.99, p99 * 1000), name
        for subscriber, values in by_subscriber.items():
            p50 = gauge(
                "mq_analytics_subscriber_latency_seconds", window=name, subscriber=subscriber, quantile="0.5"
            )
            assert within_rank(values, 0.5, p50 * 1000), (name, subscriber)
    starts = {w: gauge("mq_analytics_window_start_timestamp_seconds", window=w) for w in ("1h", "24h")}
    assert starts["24h"] < starts["1h"] < gauge("mq_analytics_last_run_timestamp_seconds")
    assert starts["1h"] % 3600 == 0
