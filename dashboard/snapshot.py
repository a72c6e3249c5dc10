"""What the live dashboard and /metrics show: a read-only snapshot of the server, for operators.

Nothing here changes a delivery, and nothing here is on the publish path. A snapshot is a fixed
handful of queries, each costing in proportion to queues, events and subscriptions, not to
rows: one read of the kept counts (delivery.tallies) gives every count per queue, event,
subscription and status, and the publishes and acks of each 10 s of the last minutes (the
rates and charts); the oldest pending delivery of each subscription is one probe of the index
of pending deliveries; the latency percentiles come from at most LATENCY_SAMPLE of the newest
acks (the index on Delivery.acked_at, with a limit); the newest messages and dead letters are
index scans with a limit; the results of the last `manage.py analyze` three small reads.
dashboard.shared computes one per second for the whole deployment; each dashboard adds its
own feed.
"""

import json
import math
from datetime import timedelta

from django.db.models import Count, Min, OuterRef
from django.db.models.functions import Coalesce, Substr
from django.utils import timezone

from delivery import health, tallies
from delivery.models import Delivery, Status, TallyActivity, WebhookHealth
from delivery.reports import first_pending_at, queue_stats
from mqsite import readers
from queues.models import Event, Message, Queue
from subscribers.models import Connection, Subscriber, Subscription

# The rates shown beside the counts ("per second") average over this window: long enough to
# be steady at a few messages a second, short enough to show a stall within a minute.
RATE_WINDOW_SECS = 60
# The charts: the last five minutes, one point per ten seconds.
SERIES_WINDOW_SECS = 300
SERIES_STEP_SECS = tallies.ACTIVITY_STEP_SECS  # the steps the fold files activity in
# Latency percentiles come from at most this many of the newest acks: enough for a steady
# p95, and a bounded read however busy the server is.
LATENCY_SAMPLE = 5000
FEED_LIMIT = 30
DEAD_LIMIT = 20
SUBSCRIBERS_LIMIT = 100
PAYLOAD_PREVIEW_CHARS = 300
HEADERS_PREVIEW_CHARS = 200  # headers are at most 8 KiB; the feed shows their start


def overview(now=None):
    """Everything but the feed: what every open dashboard shows alike, and under "metrics"
    what /metrics exposes (dashboard.metrics), from the same reads."""
    now = now or timezone.now()
    tallies.fold()  # the changes of the last moments, and their publishes and acks
    kept = tallies.counts(tallies.KEY)
    rows = queue_stats(kept)
    activity = _activity(now)
    rates, rate_secs = _rates(now, activity)
    for row in rows:
        published, acked = rates.get((row["queue"], row["event"]), (0, 0))
        row["publish_rate"] = round(published / rate_secs, 3)
        row["ack_rate"] = round(acked / rate_secs, 3)
    series = _series(now, activity)
    totals = {k: sum(r[k] for r in rows) for k in ("published", "pending", "inflight", "acked", "dead")}
    totals["publish_rate"] = round(sum(p for p, _ in rates.values()) / rate_secs, 3)
    totals["ack_rate"] = round(sum(a for _, a in rates.values()) / rate_secs, 3)
    totals.update(series.pop("latency_now"))
    oldest = oldest_pending_by_subscription()
    webhooks = list(WebhookHealth.objects.order_by())  # the webhooks that ever failed
    subscribers, connections = subscribers_with_backlog(now, kept, oldest, activity, webhooks)
    totals["connections"] = sum(connections.values())
    return {
        "at": now,
        "totals": totals,
        "queues": rows,
        "series": series,
        "subscribers": subscribers,
        "dead_letters": newest_dead_letters(),
        "history": analytics_history(),
        "metrics": _metrics_part(now, kept, oldest, (rates, rate_secs), connections, webhooks),
    }


def for_dashboard(after_message_id=None, shown_message_ids=(), now=None):
    """The whole picture for one dashboard: the overview, the messages newer than the last
    one it has, and the delivery counts of the messages it shows."""
    data = overview(now)
    data["feed"] = newest_messages(after_message_id)
    data["feed_status"] = delivery_status_of(list(shown_message_ids) + [m["id"] for m in data["feed"]])
    return data


# --- rates, throughput and latency ------------------------------------------------------------


def _activity(now):
    """The publishes and acks of each step of the charts' window, as the fold filed them
    (delivery.tallies, TallyActivity): {(step start, queue id, event id, subscriber id,
    status): n}. A few rows per step and key, however busy the server is."""
    first = _buckets(now)[0][0]
    rows = TallyActivity.objects.filter(step__gte=first).values_list(
        "step", "queue_id", "event_id", "subscriber_id", "status", "n"
    )
    return {tuple(key): n for *key, n in rows}


def rate_window(now):
    """(start, seconds) of the window the rates average over: the last RATE_WINDOW_SECS in
    whole steps of the charts, the current one included (so 50 to 60 s with steps of 10)."""
    current = _buckets(now)[-1][0]
    start = current - timedelta(seconds=RATE_WINDOW_SECS - SERIES_STEP_SECS)
    return start, max((now - start).total_seconds(), 1.0)


def _rates(now, activity):
    """({(queue, event): (published, acked)} over the rate window, its length in seconds)."""
    start, seconds = rate_window(now)
    names = {
        (queue_id, event_id): (queue, event)
        for event_id, queue_id, queue, event in Event.objects.order_by().values_list(
            "id", "queue_id", "queue__name", "name"
        )
    }
    out = {}
    for (step, queue_id, event_id, subscriber_id, status), n in activity.items():
        key = names.get((queue_id, event_id))
        if step < start or subscriber_id or key is None:
            continue
        published, acked = out.get(key, (0, 0))
        out[key] = (published + n, acked) if status == tallies.PUBLISHED else (published, acked + n)
    return out, seconds


def _buckets(now):
    """The chart's time buckets [(start, end)], oldest first, aligned to the step on the
    clock (so that they stay put between snapshots); the last one is the current, partial one."""
    step = SERIES_STEP_SECS
    # In whole seconds: the steps must equal, to the microsecond, the ones the fold files
    # activity under (a float's remainder could be a microsecond off).
    whole = now.replace(microsecond=0)
    current = whole - timedelta(seconds=int(whole.timestamp()) % step)
    count = SERIES_WINDOW_SECS // step
    starts = [current - timedelta(seconds=step * (count - 1 - i)) for i in range(count)]
    return [(s, s + timedelta(seconds=step)) for s in starts]


def percentile(sorted_values, fraction):
    """Nearest-rank percentile of an ascending list; None for an empty one."""
    if not sorted_values:
        return None
    rank = max(math.ceil(fraction * len(sorted_values)), 1)
    return sorted_values[min(rank, len(sorted_values)) - 1]


def _series(now, activity):
    buckets = _buckets(now)
    elapsed = [min(max((now - lo).total_seconds(), 1.0), SERIES_STEP_SECS) for lo, _ in buckets]
    per_step = {}
    for (step, _, _, subscriber_id, status), n in activity.items():
        if not subscriber_id:
            per_step[(step, status)] = per_step.get((step, status), 0) + n
    published = [per_step.get((lo, tallies.PUBLISHED), 0) for lo, _ in buckets]
    acked = [per_step.get((lo, Status.ACKED), 0) for lo, _ in buckets]
    # Latency is publish to ack, or a delayed message's deliver_at to ack: the wait it asked
    # for is no latency. A delivery's created_at is its message's publish time (they are
    # written together); the deliver_at is its message's, joined for the sample's rows alone.
    sample = list(
        Delivery.objects.filter(acked_at__gte=buckets[0][0])
        .order_by("-acked_at")
        .values_list("acked_at", Coalesce("message__deliver_at", "created_at"))[:LATENCY_SAMPLE]
    )
    per_bucket = [[] for _ in buckets]
    recent = []
    since = now - timedelta(seconds=RATE_WINDOW_SECS)
    first = buckets[0][0]
    for acked_at, created_at in sample:
        ms = max((acked_at - created_at).total_seconds() * 1000, 0.0)
        i = int((acked_at - first).total_seconds() // SERIES_STEP_SECS)
        if 0 <= i < len(buckets):
            per_bucket[i].append(ms)
        if acked_at >= since:
            recent.append(ms)
    for values in per_bucket:
        values.sort()
    recent.sort()

    def rounded(value):
        return None if value is None else round(value, 1)

    return {
        "step_secs": SERIES_STEP_SECS,
        "start": buckets[0][0],
        "published": [round(n / s, 3) for n, s in zip(published, elapsed, strict=True)],
        "acked": [round(n / s, 3) for n, s in zip(acked, elapsed, strict=True)],
        "latency_p50_ms": [rounded(percentile(v, 0.5)) for v in per_bucket],
        "latency_p95_ms": [rounded(percentile(v, 0.95)) for v in per_bucket],
        "latency_now": {
            "latency_p50_ms": rounded(percentile(recent, 0.5)),
            "latency_p95_ms": rounded(percentile(recent, 0.95)),
            "latency_samples": len(recent),
        },
    }


# --- the analytics: what the last `manage.py analyze` computed over the whole history ---------

# Read by the analytics app (analytics/summaries.py), which sits beside the dashboard: it hands
# its readers over at start (analytics.apps, through mqsite.readers), so neither imports the other.


def analytics_history():
    """The stored results of the last analytics run, for the dashboard's history panel."""
    return readers.read("analytics.history")


# --- who receives what, and what they are still owed --------------------------------------------


def oldest_pending_by_subscription():
    """{subscription id: (its subscriber id, its queue id, when its oldest pending delivery was
    published)} for the subscriptions with something pending: one probe each of the index of
    pending deliveries by (subscription, seq), as the lowest seq pending is the oldest
    published. One query, whatever the backlog."""
    rows = (
        Subscription.objects.order_by()
        .annotate(oldest=first_pending_at(OuterRef("pk")))
        .filter(oldest__isnull=False)
        .values_list("id", "subscriber_id", "queue_id", "oldest")
    )
    return {sid: (subscriber_id, queue_id, oldest) for sid, subscriber_id, queue_id, oldest in rows}


def subscribers_with_backlog(now, kept, oldest, activity, webhooks):
    """Subscribers that are connected or hold a subscription, the most owed first: their open
    websockets, what they subscribe to, their backlog and their acks per second; and
    {subscriber id: open websockets} of all of them.

    `kept`: the kept counts by full key; `oldest`: oldest_pending_by_subscription();
    `activity`: _activity(); `webhooks`: the WebhookHealth rows. Two more queries:
    subscriptions, connections.
    """
    subscriptions = {}
    names = {}
    for s in Subscription.objects.select_related("subscriber", "queue", "event").order_by(
        "queue__name", "event__name", "id"
    ):
        names[s.subscriber_id] = s.subscriber.name
        subscriptions.setdefault(s.subscriber_id, []).append(
            {"queue": s.queue.name, "event": s.event.name if s.event_id else None, "paused": s.paused}
        )
    connections = {}
    for row in (
        Connection.objects.order_by()
        .values("subscriber_id", "subscriber__name")
        .annotate(n=Count("id"), since=Min("connected_at"))
    ):
        names[row["subscriber_id"]] = row["subscriber__name"]
        connections[row["subscriber_id"]] = row
    backlog = tallies.regroup(kept, ("subscriber_id", "status"))
    oldest_of = {}
    for subscriber_id, _, at in oldest.values():
        oldest_of[subscriber_id] = min(at, oldest_of.get(subscriber_id, at))
    disabled = {
        h.subscriber_id: {
            "since": h.disabled_since,
            "failures": h.disabled_after if h.disabled_after is not None else h.failures,
            "last_error": h.last_error[:300],
        }
        for h in webhooks
        if h.disabled_since is not None
    }
    for sid in disabled:  # a disabled webhook is shown even with nothing subscribed
        names.setdefault(sid, None)
    if any(name is None for name in names.values()):
        missing = [sid for sid, name in names.items() if name is None]
        names.update(Subscriber.objects.filter(pk__in=missing).values_list("pk", "name"))
    start, rate_secs = rate_window(now)
    acks = {}
    for (step, queue_id, _, subscriber_id, status), n in activity.items():
        if subscriber_id and not queue_id and status == Status.ACKED and step >= start:
            acks[subscriber_id] = acks.get(subscriber_id, 0) + n
    out = []
    for sid, name in names.items():
        conn = connections.get(sid)
        at = oldest_of.get(sid)
        out.append(
            {
                "subscriber": name,
                "connections": conn["n"] if conn else 0,
                "connected_since": conn["since"] if conn else None,
                "subscriptions": subscriptions.get(sid, []),
                "pending": backlog.get((sid, Status.PENDING), 0),
                "inflight": backlog.get((sid, Status.INFLIGHT), 0),
                "dead": backlog.get((sid, Status.DEAD), 0),
                "oldest_pending_age_s": round((now - at).total_seconds(), 1) if at else None,
                "ack_rate": round(acks.get(sid, 0) / rate_secs, 3),
                # Its webhook, when disabled (delivery.webhook_health): since, failures, last error.
                "webhook_disabled": disabled.get(sid),
            }
        )
    out.sort(key=lambda s: (-s["pending"], -s["inflight"], s["subscriber"]))
    return out[:SUBSCRIBERS_LIMIT], {sid: c["n"] for sid, c in connections.items()}


def _metrics_part(now, kept, oldest, rated, connections, webhooks):
    """What /metrics exposes beyond the dashboard's figures, by name (dashboard.metrics):
    `rated` as _rates() gives it, unrounded."""
    rates, rate_secs = rated
    queues = list(Queue.objects.order_by("name").values_list("id", "name", "last_seq", "paused"))
    queue_names = {qid: name for qid, name, _, _ in queues}
    subscriber_names = dict(Subscriber.objects.order_by().values_list("id", "name"))
    pending = {}
    for (queue_id, subscriber_id, status), n in tallies.regroup(
        kept, ("queue_id", "subscriber_id", "status")
    ).items():
        if status == Status.PENDING and queue_id in queue_names and subscriber_id in subscriber_names:
            pending[(queue_names[queue_id], subscriber_names[subscriber_id])] = [n, None]
    for subscriber_id, queue_id, at in oldest.values():
        entry = pending.get((queue_names.get(queue_id), subscriber_names.get(subscriber_id)))
        if entry is not None:
            age = max((now - at).total_seconds(), 0.0)
            entry[1] = age if entry[1] is None else max(entry[1], age)
    per_queue = {}
    for (queue, _), (published, acked) in rates.items():
        counted = per_queue.setdefault(queue, [0, 0])
        counted[0] += published
        counted[1] += acked
    return {
        "queues": [
            {
                "name": name,
                "last_seq": last_seq,
                "paused": paused,
                "publish_rate": per_queue.get(name, (0, 0))[0] / rate_secs,
                "ack_rate": per_queue.get(name, (0, 0))[1] / rate_secs,
            }
            for _, name, last_seq, paused in queues
        ],
        "pending": [
            {"queue": q, "subscriber": s, "n": n, "oldest_age_s": age}
            for (q, s), (n, age) in sorted(pending.items())
        ],
        "connections": sorted(
            (subscriber_names[sid], n) for sid, n in connections.items() if sid in subscriber_names
        ),
        "webhook_attempts": webhook_attempts(kept, subscriber_names),
        "webhooks": webhook_states(webhooks, subscriber_names),
        # The beats of the processes that do the work and the sweep's age, as /healthz reads them.
        "processes": health.process_checks()[0],
        "analytics": analytics_metrics(),
    }


def webhook_states(webhooks, names):
    """[(subscriber, failed attempts in a row, disabled)] of the webhooks that ever failed (a
    healthy webhook's subscriber has no WebhookHealth row until its first failure)."""
    return sorted(
        (names[h.subscriber_id], h.failures, h.disabled_since is not None)
        for h in webhooks
        if h.subscriber_id in names
    )


def analytics_metrics():
    """The last loaded analytics run for /metrics, or None before the first run."""
    return readers.read("analytics.metrics")


def webhook_attempts(kept, names):
    """[(subscriber, ok, http_error, error)]: the webhook posts recorded in the hot tables, by
    outcome, from the kept counts. `names`: {subscriber id: name}."""
    out = {}
    for (subscriber_id, status), n in tallies.regroup(kept, ("subscriber_id", "status")).items():
        if status in tallies.ATTEMPT_OUTCOMES and subscriber_id in names:
            out.setdefault(names[subscriber_id], [0, 0, 0])[tallies.ATTEMPT_OUTCOMES.index(status)] = n
    return [(name, *counts) for name, counts in sorted(out.items())]


def newest_dead_letters(limit=DEAD_LIMIT):
    """The newest dead deliveries (by their last scheduled attempt, which the status index
    orders: the ledger keeps no time of death), newest first."""
    rows = (
        Delivery.objects.filter(status=Status.DEAD)
        .order_by("-next_attempt_at", "-id")
        .values(
            "id",
            "message_id",
            "subscriber__name",
            "queue__name",
            "event__name",
            "seq",
            "attempt",
            "last_error",
            "created_at",
        )[:limit]
    )
    return [
        {
            "id": r["id"],
            "message_id": r["message_id"],
            "subscriber": r["subscriber__name"],
            "queue": r["queue__name"],
            "event": r["event__name"],
            "seq": r["seq"],
            "attempt": r["attempt"],
            "last_error": r["last_error"],
            "published_at": r["created_at"],
        }
        for r in rows
    ]


# --- the feed ------------------------------------------------------------------------------------


def newest_messages(after_id=None, limit=FEED_LIMIT):
    """The newest messages (after `after_id`, when given), newest first, with the start of
    their payload (a payload may be large: only its first characters are read) and of their
    headers, when they have some."""
    messages = Message.objects.all()
    if after_id is not None:
        messages = messages.filter(id__gt=after_id)
    rows = (
        messages.order_by("-id")
        .annotate(
            preview=Substr("payload_json", 1, PAYLOAD_PREVIEW_CHARS + 1),
            headers_preview=Substr("headers_json", 1, HEADERS_PREVIEW_CHARS + 1),
        )
        .values(
            "id",
            "queue__name",
            "event__name",
            "seq",
            "created_at",
            "publisher__name",
            "preview",
            "headers_preview",
            "receipt_wanted",
        )[:limit]
    )
    return [
        {
            "id": r["id"],
            "queue": r["queue__name"],
            "event": r["event__name"],
            "seq": r["seq"],
            "published_at": r["created_at"],
            "publisher": r["publisher__name"],
            "payload": _preview(r["preview"]),
            **({"headers": _headers_preview(r["headers_preview"])} if r["headers_preview"] else {}),
            "receipt": r["receipt_wanted"],  # its publisher waits for a receipt
        }
        for r in rows
    ]


def _headers_preview(text):
    """name=value pairs, for reading; the start of the stored text when there is more."""
    if len(text) > HEADERS_PREVIEW_CHARS:
        return text[:HEADERS_PREVIEW_CHARS] + "…"
    try:
        return "  ".join(f"{name}={value}" for name, value in json.loads(text).items())
    except (ValueError, AttributeError):
        return text


def _preview(text):
    if len(text) > PAYLOAD_PREVIEW_CHARS:
        return text[:PAYLOAD_PREVIEW_CHARS] + "…"
    try:  # re-encode compactly with a space after separators, for reading
        return json.dumps(json.loads(text), ensure_ascii=False, separators=(", ", ": "))
    except ValueError:
        return text


def delivery_status_of(message_ids):
    """{message id: {pending, inflight, acked, dead}} for these messages: one grouped query
    (over the index on Delivery.message)."""
    ids = list(dict.fromkeys(message_ids))
    out = {i: {s.value: 0 for s in Status} for i in ids}
    if not ids:
        return out
    rows = (
        Delivery.objects.filter(message_id__in=ids)
        .order_by()
        .values_list("message_id", "status")
        .annotate(n=Count("id"))
    )
    for message_id, status, n in rows:
        out[message_id][status] = n
    return out
