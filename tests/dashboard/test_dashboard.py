"""The live dashboard: the page at /, its websocket at /ws/dashboard/, and its redeliver button.

The world: the `db` queue; `logger` subscribed to every event of it and `peer` to db/create;
four messages published; the logger has acked two of its deliveries, one of the peer's is
dead. The operator is a staff user logged in through the admin's session.
"""

import json
from datetime import timedelta

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.contrib.admin.models import LogEntry
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from analytics.models import EventStats, EventTrend, SubscriberStats
from dashboard import consumers, snapshot
from delivery import ledger, presence, subscribing
from delivery.models import Delivery, Status
from delivery.publishing import prepare, publish
from delivery.reports import queue_stats
from mqsite.asgi import application
from queues.models import Message, Queue
from subscribers.provisioning import create_subscriber

ORIGIN = (b"origin", b"http://127.0.0.1:8000")


def make_world():
    queue = Queue.objects.create(name="db")
    logger, _ = create_subscriber("logger", publish=["db"], subscribe=["db"])
    peer, _ = create_subscriber("peer", publish=["db"], subscribe=["db"])
    subscribing.subscribe(logger, queue)
    subscribing.subscribe(peer, queue, "create")
    publish(queue, [prepare("create", {"n": 1}), prepare("delete", {"n": 2}), prepare("create", {"n": 3})])
    publish(queue, [prepare("create", {"html": "<script>alert(1)</script>"})])
    leased = ledger.lease_deliveries(logger, limit=2)
    ledger.ack_deliveries(logger, [d["id"] for d in leased])
    first = Delivery.objects.filter(subscriber=peer).order_by("id").first()
    ledger.kill_deliveries(Delivery.objects.filter(pk=first.pk), reason="poison")
    presence.open_connection(peer, "specific.peer-1", "127.0.0.1")
    return {"queue": queue, "logger": logger, "peer": peer}


def session_cookie(user):
    client = Client()
    client.force_login(user)
    return f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}"


async def open_dashboard(cookie=None, origin=ORIGIN):
    headers = [origin] if origin else []
    if cookie:
        headers.append((b"cookie", cookie.encode()))
    comm = WebsocketCommunicator(application, "/ws/dashboard/", headers=headers)
    connected, code = await comm.connect(timeout=5)
    return comm, connected, code


async def next_snapshot(comm, timeout=5):
    frame = json.loads(await comm.receive_from(timeout=timeout))
    assert frame["type"] == "snapshot"
    return frame


@pytest.fixture
def plain_user(django_user_model):
    return django_user_model.objects.create_user("visitor", password="visitor-password-1")


# --- the websocket ----------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_it_sends_staff_a_snapshot_that_matches_the_database(operator):
    world = await database_sync_to_async(make_world)()
    cookie = await database_sync_to_async(session_cookie)(operator)

    comm, connected, _ = await open_dashboard(cookie)
    assert connected
    snap = await next_snapshot(comm)

    @database_sync_to_async
    def expected():
        counts = {s: Delivery.objects.filter(status=s).count() for s in Status.values}
        return counts, queue_stats(), list(Message.objects.order_by("-id").values_list("id", flat=True))

    counts, stats, message_ids = await expected()
    assert snap["totals"]["published"] == len(message_ids) == 4
    assert snap["totals"]["pending"] == counts["pending"]
    assert snap["totals"]["inflight"] == counts["inflight"]
    assert snap["totals"]["acked"] == counts["acked"] == 2
    assert snap["totals"]["dead"] == counts["dead"] == 1
    assert snap["totals"]["connections"] == 1
    keys = ("queue", "event", "published", "pending", "inflight", "acked", "dead", "connected")
    assert [{k: r[k] for k in keys} for r in snap["queues"]] == stats
    # Two acks just now: the rate over the last minute counts them.
    assert snap["totals"]["ack_rate"] in {round(2 / secs, 3) for secs in range(50, 61)}
    assert snap["totals"]["latency_samples"] == 2
    assert sum(snap["series"]["acked"]) > 0 and len(snap["series"]["published"]) == 30

    # The feed: every message, newest first, payloads as text (the page never parses them as HTML).
    assert [m["id"] for m in snap["feed"]] == message_ids
    assert snap["feed"][0]["payload"] == '{"html": "<script>alert(1)</script>"}'
    assert snap["feed_status"][str(message_ids[-1])] == {"pending": 0, "inflight": 0, "acked": 1, "dead": 1}

    subscribers = {s["subscriber"]: s for s in snap["subscribers"]}
    assert subscribers["peer"]["connections"] == 1
    assert subscribers["peer"]["subscriptions"] == [{"queue": "db", "event": "create", "paused": False}]
    assert (subscribers["peer"]["pending"], subscribers["peer"]["dead"]) == (2, 1)
    assert subscribers["logger"]["connections"] == 0
    assert subscribers["logger"]["pending"] == 2
    assert subscribers["logger"]["subscriptions"] == [{"queue": "db", "event": None, "paused": False}]

    # No analytics run yet: the page says how to make one.
    assert snap["history"] == {
        "computed_at": None,
        "events": [],
        "subscribers": [],
        "hourly": {"start": None, "messages": []},
    }

    [dead] = snap["dead_letters"]
    dead_row = await database_sync_to_async(Delivery.objects.get)(status=Status.DEAD)
    assert (dead["id"], dead["subscriber"], dead["last_error"]) == (dead_row.pk, "peer", "poison")

    # Live: a publish shows up within a tick or two without asking, and only it is new. (A
    # tick that began before the publish committed may show it in its feed and not yet in its
    # counts, or the other way round.)
    await database_sync_to_async(publish)(world["queue"], [prepare("update", {"n": 5})])
    seen, published = [], None
    for _ in range(4):
        snap2 = await next_snapshot(comm)
        seen += snap2["feed"]
        statuses = snap2["feed_status"]
        published = snap2["totals"]["published"]
        if seen and published == 5:
            break
    assert published == 5
    [new] = seen
    assert (new["queue"], new["event"], new["payload"]) == ("db", "update", '{"n": 5}')
    assert statuses[str(new["id"])]["pending"] == 1  # the logger's; the peer wants creates
    await comm.disconnect()


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_it_refuses_anyone_but_staff(plain_user):
    cookie = await database_sync_to_async(session_cookie)(plain_user)
    for who in (None, cookie):
        comm, connected, code = await open_dashboard(who)
        assert not connected, who
        await comm.disconnect()


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_it_refuses_a_page_of_another_site(operator):
    cookie = await database_sync_to_async(session_cookie)(operator)
    comm, connected, _ = await open_dashboard(cookie, origin=(b"origin", b"https://evil.example"))
    assert not connected
    await comm.disconnect()


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_it_refuses_an_opaque_origin_that_would_carry_the_operators_cookie(operator):
    """`Origin: null` is let in on /ws/ (token only), never here: any site can make a browser
    send it, from a sandboxed iframe, with the operator's session cookie."""
    cookie = await database_sync_to_async(session_cookie)(operator)
    comm, connected, _ = await open_dashboard(cookie, origin=(b"origin", b"null"))
    assert not connected
    await comm.disconnect()


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_it_closes_when_the_operator_logs_out(operator, monkeypatch):
    monkeypatch.setattr(consumers, "RECHECK_USER_SECS", 0)
    client = await database_sync_to_async(Client)()
    await database_sync_to_async(client.force_login)(operator)
    cookie = f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}"
    comm, connected, _ = await open_dashboard(cookie)
    assert connected
    await next_snapshot(comm)
    await database_sync_to_async(client.logout)()
    # The next tick finds the session gone and closes the socket.
    for _ in range(3):
        out = await comm.receive_output(timeout=5)
        if out["type"] == "websocket.close":
            assert out["code"] == consumers.CLOSE_NOT_STAFF
            break
    else:
        raise AssertionError("the dashboard stayed open after the logout")


# --- the service, without a socket -------------------------------------------------------------


@pytest.mark.django_db
def test_it_computes_latency_percentiles_and_rates_from_the_acks():
    queue = Queue.objects.create(name="db")
    logger, _ = create_subscriber("logger", subscribe=["db"])
    subscribing.subscribe(logger, queue)
    publish(queue, [prepare("create", i) for i in range(20)])
    published_at = Message.objects.first().created_at
    leased = ledger.lease_deliveries(logger, limit=20)
    # Acked 100 ms, 200 ms, ... 2 s after publishing.
    for i, d in enumerate(sorted(leased, key=lambda d: d["seq"])):
        ledger.ack_deliveries(logger, [d["id"]], now=published_at + timedelta(milliseconds=100 * (i + 1)))

    now = published_at + timedelta(seconds=3)
    data = snapshot.overview(now=now)
    _, rate_secs = snapshot.rate_window(now)
    assert 50 <= rate_secs <= 60

    assert data["totals"]["latency_p50_ms"] == 1000.0
    assert data["totals"]["latency_p95_ms"] == 1900.0
    assert data["totals"]["latency_samples"] == 20
    assert data["totals"]["publish_rate"] == round(20 / rate_secs, 3)
    assert data["totals"]["ack_rate"] == round(20 / rate_secs, 3)
    # The acks fall in the chart's last one or two 10 s buckets (as the clock cuts them), each
    # with the p95 of its own acks.
    p95 = [v for v in data["series"]["latency_p95_ms"] if v is not None]
    assert 1 <= len(p95) <= 2 and max(p95) in (1900.0, 2000.0)
    assert all(100.0 <= v <= 2000.0 for v in p95)


@pytest.mark.django_db
def test_the_latency_of_a_delayed_message_counts_from_its_deliver_at():
    """The wait it asked for is no latency: a message delayed by 10 s and acked 300 ms after
    its deliver_at counts 300 ms, beside an undelayed one acked 100 ms after its publish."""
    queue = Queue.objects.create(name="db")
    logger, _ = create_subscriber("logger", subscribe=["db"])
    subscribing.subscribe(logger, queue)
    publish(queue, [prepare("create", 1, delay_secs=10), prepare("create", 2)])
    delayed, undelayed = Message.objects.order_by("seq")
    leased = ledger.lease_deliveries(logger, limit=2, now=delayed.deliver_at)
    by_seq = {d["seq"]: d["id"] for d in leased}
    ledger.ack_deliveries(logger, [by_seq[1]], now=delayed.deliver_at + timedelta(milliseconds=300))
    ledger.ack_deliveries(logger, [by_seq[2]], now=undelayed.created_at + timedelta(milliseconds=100))

    data = snapshot.overview(now=delayed.deliver_at + timedelta(seconds=1))
    assert data["totals"]["latency_samples"] == 2
    assert data["totals"]["latency_p95_ms"] == 300.0  # not 10.3 s
    assert data["totals"]["latency_p50_ms"] == 100.0


def test_the_charts_steps_are_whole_steps_of_the_clock():
    """The steps the fold files publishes and acks under (whole 10 s of the clock) are the
    chart's, to the microsecond, whatever the microseconds of now."""
    from datetime import UTC, datetime

    for micro in (0, 1, 123457, 999999):
        now = datetime(2026, 11, 25, 10, 0, 7, micro, tzinfo=UTC)
        buckets = snapshot._buckets(now)
        assert buckets[-1][0] == datetime(2026, 11, 25, 10, 0, 0, tzinfo=UTC)
        assert len(buckets) == snapshot.SERIES_WINDOW_SECS // snapshot.SERIES_STEP_SECS
        assert all(lo.microsecond == 0 and lo.second % 10 == 0 for lo, _ in buckets)


def store_analytics(computed_at, events=(("db", "create"),), subscribers=("logger",), hours=()):
    """Rows as analytics.load stores them after a run of the job."""
    for i, (queue, event) in enumerate(events):
        EventStats.objects.create(
            queue=queue,
            event=event,
            messages=30 + i,
            deliveries=60,
            pending=2,
            inflight=1,
            acked=54,
            dead=3,
            fanout=2.0,
            latency_p50_ms=12.5,
            latency_p95_ms=80.0,
            latency_p99_ms=140.25,
            attempts_mean=1.4,
            dead_letter_rate=0.05,
            messages_per_minute=0.5,
            messages_per_hour=30.0,
            peak_per_minute=7,
            peak_per_hour=30,
            computed_at=computed_at,
        )
        for hour, n in hours:
            EventTrend.objects.create(
                queue=queue,
                event=event,
                period="hour",
                period_start=hour,
                messages=n,
                deliveries=2 * n,
                acked=2 * n,
                dead=0,
            )
        # Daily trends are not the hourly chart's
        if hours:
            EventTrend.objects.create(
                queue=queue,
                event=event,
                period="day",
                period_start=hours[0][0],
                messages=999,
                deliveries=0,
                acked=0,
                dead=0,
            )
    for name in subscribers:
        SubscriberStats.objects.create(
            subscriber=name,
            deliveries=60,
            pending=2,
            inflight=1,
            acked=54,
            dead=3,
            oldest_pending_age_s=42.5,
            computed_at=computed_at,
        )


@pytest.mark.django_db
def test_it_shows_the_last_analytics_run_beside_the_live_figures():
    make_world()
    # Given no run of `analyze` yet: an empty panel, which the page explains
    assert snapshot.for_dashboard()["history"]["computed_at"] is None

    # Given a run that found two events, one subscriber, and messages in three hours (none
    # in the one between the second and the third)
    computed_at = timezone.now().replace(microsecond=0)
    hour = computed_at.replace(minute=0, second=0) - timedelta(hours=5)
    store_analytics(
        computed_at,
        events=[("db", "create"), ("network", "error")],
        subscribers=["logger", "monitor"],
        hours=[(hour, 4), (hour + timedelta(hours=1), 6), (hour + timedelta(hours=3), 1)],
    )
    SubscriberStats.objects.filter(subscriber="monitor").update(
        pending=0, inflight=0, oldest_pending_age_s=None
    )

    # When
    history = snapshot.for_dashboard()["history"]

    # Then: when it ran, and its figures per queue and event ...
    assert history["computed_at"] == computed_at
    assert [(e["queue"], e["event"]) for e in history["events"]] == [("db", "create"), ("network", "error")]
    create = history["events"][0]
    assert (create["messages"], create["deliveries"], create["acked"], create["dead"]) == (30, 60, 54, 3)
    assert (create["latency_p50_ms"], create["latency_p95_ms"], create["latency_p99_ms"]) == (
        12.5,
        80.0,
        140.25,
    )
    assert (create["attempts_mean"], create["dead_letter_rate"], create["fanout"]) == (1.4, 0.05, 2.0)
    assert (create["messages_per_minute"], create["messages_per_hour"], create["peak_per_minute"]) == (
        0.5,
        30.0,
        7,
    )
    # ... per subscriber, the most owed first: backlog (pending and in flight) and lag ...
    assert history["subscribers"] == [
        {
            "subscriber": "logger",
            "deliveries": 60,
            "pending": 2,
            "inflight": 1,
            "backlog": 3,
            "dead": 3,
            "lag_s": 42.5,
        },
        {
            "subscriber": "monitor",
            "deliveries": 60,
            "pending": 0,
            "inflight": 0,
            "backlog": 0,
            "dead": 3,
            "lag_s": None,
        },
    ]
    # ... and the messages per hour over both events, the empty hour as 0
    assert history["hourly"] == {"start": hour, "messages": [8, 12, 0, 2]}


@pytest.mark.django_db
def test_it_asks_the_same_number_of_queries_for_many_rows(django_assert_max_num_queries):
    world = make_world()
    # A fixed number (31 with /metrics' liveness of the processes, as /healthz reads it); the
    # point is the second half: no more for more rows.
    with django_assert_max_num_queries(32) as few:
        snapshot.for_dashboard()
    baseline = len(few.captured_queries)
    for i in range(5):
        s, _ = create_subscriber(f"extra{i}", subscribe=["db"])
        subscribing.subscribe(s, world["queue"], "create")
        presence.open_connection(s, f"specific.extra-{i}")
    publish(world["queue"], [prepare("create", {"i": i}) for i in range(30)])
    ledger.kill_deliveries(Delivery.objects.filter(subscriber__name="extra1"))
    hour = timezone.now().replace(minute=0, second=0, microsecond=0)
    store_analytics(
        timezone.now(),
        events=[("db", f"e{i}") for i in range(10)],
        subscribers=[f"s{i}" for i in range(10)],
        hours=[(hour - timedelta(hours=h), 3) for h in range(100)],
    )
    shown = list(Message.objects.values_list("id", flat=True))
    with django_assert_max_num_queries(baseline):
        snapshot.for_dashboard(shown_message_ids=shown)


# --- the page and the redeliver button ----------------------------------------------------------


@pytest.mark.django_db
def test_the_page_sends_everyone_but_staff_to_the_admin_login(client, plain_user, operator):
    r = client.get("/")
    assert r.status_code == 302 and r["Location"] == "/admin/login/?next=/"
    client.force_login(plain_user)
    assert client.get("/")["Location"] == "/admin/login/?next=/"
    client.force_login(operator)
    page = client.get("/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "dashboard/dashboard.js" in html and 'id="feed"' in html
    # The page's script and style are served by the app itself (whitenoise), not a CDN.
    assert "http" not in "".join(
        line for line in html.splitlines() if "<script" in line or "stylesheet" in line
    )


@pytest.mark.django_db
def test_it_redelivers_a_dead_letter_with_a_csrf_checked_post(operator, plain_user):
    make_world()
    dead = Delivery.objects.get(status=Status.DEAD)
    url = reverse("dashboard-redeliver", args=[dead.pk])

    staff = Client(enforce_csrf_checks=True)
    staff.force_login(operator)
    assert staff.post(url).status_code == 403  # no CSRF token
    assert staff.get(url).status_code == 405
    token = str(staff.get("/").context["csrf_token"])

    r = staff.post(url, HTTP_X_CSRFTOKEN=token)

    assert r.status_code == 200 and r.json() == {"redelivered": 1}
    dead.refresh_from_db()
    assert (dead.status, dead.attempt, dead.last_error) == (Status.PENDING, 0, "redelivered by an operator")
    assert dead.next_attempt_at <= timezone.now()
    assert LogEntry.objects.get(object_id=str(dead.pk)).user == operator
    # Not dead any more: a second press says so instead of moving it again.
    assert staff.post(url, HTTP_X_CSRFTOKEN=token).status_code == 409
    assert staff.post(reverse("dashboard-redeliver", args=[10**9]), HTTP_X_CSRFTOKEN=token).status_code == 404


@pytest.mark.django_db
def test_it_refuses_redelivery_to_anyone_but_staff(client, plain_user):
    make_world()
    dead = Delivery.objects.get(status=Status.DEAD)
    url = reverse("dashboard-redeliver", args=[dead.pk])
    assert client.post(url).status_code == 403
    client.force_login(plain_user)
    assert client.post(url).status_code == 403
    dead.refresh_from_db()
    assert dead.status == Status.DEAD
