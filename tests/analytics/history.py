"""A generated delivery history with known answers, and those answers computed in plain Python.

The history is written as the archive would hold it (analytics.layout) and the snapshot of the
hot tables would see it, with the overlap a crash can leave: some archived batches also in the
hot tables, seen there before their acks. The expected figures are computed from the
unique rows here, with no Spark and no SQL.
"""

import math
import random
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pytest

from analytics import layout

NOW = datetime(2026, 11, 20, 12, 0, tzinfo=UTC)
START = NOW - timedelta(days=3)
SUBSCRIBERS = ("logger", "monitor", "peer")
EVENTS = {"db": ("create", "delete"), "network": ("error",)}
MAX_ATTEMPTS = 4


@dataclass
class History:
    messages: list = field(default_factory=list)  # dicts with the layout's fields + queue
    deliveries: list = field(default_factory=list)

    def message_tuple(self, m):
        return tuple(m[f] for f in layout.MESSAGE_SCHEMA.names)

    def delivery_tuple(self, d):
        return tuple(d[f] for f in layout.DELIVERY_SCHEMA.names)


def generate(seed=7, n_messages=600):
    """Messages over three days; each fans out to 0-3 subscribers; settled history in the
    archive, the rest (and some overlap) in the recent rows."""
    rng = random.Random(seed)
    h = History()
    delivery_id = 10_000
    for message_id in range(1, n_messages + 1):
        queue = rng.choice(sorted(EVENTS))
        event = rng.choice(EVENTS[queue])
        # Bursty: most messages in a few busy minutes, the rest spread out.
        if rng.random() < 0.5:
            created = START + timedelta(hours=rng.choice((5, 30, 50)), seconds=rng.uniform(0, 180))
        else:
            created = START + timedelta(seconds=rng.uniform(0, 3 * 86400 - 3600))
        created = created.replace(microsecond=rng.randrange(1_000_000))
        h.messages.append(
            {
                "id": message_id,
                "queue": queue,
                "event": event,
                "seq": message_id,
                "created_at": created,
                "payload": f'{{"n":{message_id},"text":"caf\\u00e9"}}',
                "key": None,
                "publisher": rng.choice((None, "logger")),
                # Some with headers (no draw from rng: the history stays the same otherwise).
                "headers": f'{{"tenant":"t{message_id % 3}"}}' if message_id % 4 == 0 else None,
            }
        )
        for subscriber in rng.sample(SUBSCRIBERS, rng.choice((0, 1, 2, 2, 3, 3))):
            delivery_id += 1
            status = rng.choices(("acked", "dead", "pending", "inflight"), weights=(80, 6, 10, 4))[0]
            acked_at = None
            attempts = rng.randint(1, MAX_ATTEMPTS)
            if status == "acked":
                acked_at = created + timedelta(microseconds=int(rng.lognormvariate(11, 1.5)))
            elif status == "dead":
                attempts = MAX_ATTEMPTS
            elif status == "pending":
                attempts = rng.randint(0, MAX_ATTEMPTS - 1)
            h.deliveries.append(
                {
                    "id": delivery_id,
                    "message_id": message_id,
                    "queue": queue,
                    "event": event,
                    "subscriber": subscriber,
                    "seq": message_id,
                    "status": status,
                    "attempts": attempts,
                    "created_at": created,
                    "delivered_at": created if attempts else None,
                    "acked_at": acked_at,
                    "last_error": "",
                }
            )
    _replay(h, random.Random(seed + 1), delivery_id)
    return h


# Replays: a subscriber that came later with "from" (delivery.subscribing.subscribe_from) is
# owed old messages by deliveries made at the replay, days after their messages. The archive
# files them under their message's day; one replay falls on a day with no archived partition,
# the other on a day that has one. (A random generator of their own: the rest of the history
# stays as it was.)
REPLAYER = "replayer"
REPLAYS = {"db": START + timedelta(days=2, hours=2), "network": START + timedelta(days=2, hours=14)}


def _replay(h, rng, delivery_id):
    for m in list(h.messages):
        at = REPLAYS[m["queue"]]
        if m["created_at"] >= START + timedelta(days=1, hours=12) or rng.random() < 0.4:
            continue
        delivery_id += 1
        status = rng.choices(("acked", "pending"), weights=(90, 10))[0]
        h.deliveries.append(
            {
                "id": delivery_id,
                "message_id": m["id"],
                "queue": m["queue"],
                "event": m["event"],
                "subscriber": REPLAYER,
                "seq": m["seq"],
                "status": status,
                "attempts": 1 if status == "acked" else 0,
                "created_at": at,
                "delivered_at": at if status == "acked" else None,
                "acked_at": at + timedelta(microseconds=int(rng.lognormvariate(10, 1)))
                if status == "acked"
                else None,
                "last_error": "",
            }
        )


@dataclass
class Snapshot:
    """The hot tables' snapshot as analytics.extract takes it (its HotSnapshot's fields)."""

    messages: pa.Table
    deliveries: pa.Table


def write(h, archive):
    """Write the settled messages of the first two days to the archive, in batches, and return
    the snapshot of the hot tables: everything else, plus the overlap a crash leaves (every
    third batch also still in the hot tables). The hot copy of that overlap is stale, as a
    snapshot taken before the acks would be: its deliveries pending, not acked. The archive's
    copy must win."""
    cutoff = START + timedelta(days=2)
    by_message = defaultdict(list)
    for d in h.deliveries:
        by_message[d["message_id"]].append(d)
    archived, hot, stale = [], [], set()
    for m in h.messages:
        settled = all(d["status"] == "acked" for d in by_message[m["id"]])
        (archived if m["created_at"] < cutoff and settled else hot).append(m)
    for queue in sorted(EVENTS):
        rows = [m for m in archived if m["queue"] == queue]
        for i in range(0, len(rows), 40):
            _write(h, archive, queue, rows[i : i + 40], by_message)
            if i // 40 % 3 == 1:
                hot.extend(rows[i : i + 40])
                stale.update(m["id"] for m in rows[i : i + 40])
    hot_deliveries = []
    for m in hot:
        for d in by_message[m["id"]]:
            if m["id"] in stale:
                d = {**d, "status": "pending", "acked_at": None}
            hot_deliveries.append(d)
    return Snapshot(
        pa.Table.from_pylist(
            [{f: m[f] for f in layout.HOT_MESSAGE_SCHEMA.names} for m in hot], layout.HOT_MESSAGE_SCHEMA
        ),
        pa.Table.from_pylist(
            [{f: d[f] for f in layout.HOT_DELIVERY_SCHEMA.names} for d in hot_deliveries],
            layout.HOT_DELIVERY_SCHEMA,
        ),
    )


def _write(h, root, queue, messages, by_message):
    deliveries = [d for m in messages for d in by_message[m["id"]]]
    layout.write_history(
        root,
        queue,
        [h.message_tuple(m) for m in messages],
        [h.delivery_tuple(d) for d in deliveries],
        durable=False,
    )


# --- the expected figures, in plain Python -------------------------------------------------------


def latency_ms(d):
    delta = d["acked_at"] - d["created_at"]
    return (delta.days * 86_400_000_000 + delta.seconds * 1_000_000 + delta.microseconds) / 1000


def expected_events(h):
    out = {}
    keys = {(m["queue"], m["event"]) for m in h.messages}
    for key in sorted(keys):
        ms = [m for m in h.messages if (m["queue"], m["event"]) == key]
        ds = [d for d in h.deliveries if (d["queue"], d["event"]) == key]
        count = {s: sum(d["status"] == s for d in ds) for s in ("pending", "inflight", "acked", "dead")}
        settled = [d["attempts"] for d in ds if d["status"] in ("acked", "dead")]
        minutes = defaultdict(int)
        hours = defaultdict(int)
        for m in ms:
            minutes[m["created_at"].replace(second=0, microsecond=0)] += 1
            hours[m["created_at"].replace(minute=0, second=0, microsecond=0)] += 1
        first, last = min(minutes), max(minutes)
        first_h, last_h = min(hours), max(hours)
        out[key] = {
            "messages": len(ms),
            "deliveries": len(ds),
            **count,
            "fanout": len(ds) / len(ms),
            "latencies": sorted(latency_ms(d) for d in ds if d["status"] == "acked"),
            "attempts_mean": sum(settled) / len(settled) if settled else None,
            "dead_letter_rate": count["dead"] / len(ds) if ds else None,
            "per_minute": dict(minutes),
            "per_hour": dict(hours),
            "messages_per_minute": len(ms) / ((last - first) / timedelta(minutes=1) + 1),
            "messages_per_hour": len(ms) / ((last_h - first_h) / timedelta(hours=1) + 1),
            "peak_per_minute": max(minutes.values()),
            "peak_per_hour": max(hours.values()),
            "first_published_at": min(m["created_at"] for m in ms),
            "last_published_at": max(m["created_at"] for m in ms),
        }
    return out


def expected_subscribers(h, now=NOW):
    out = {}
    for name in sorted({d["subscriber"] for d in h.deliveries}):
        ds = [d for d in h.deliveries if d["subscriber"] == name]
        pending = [d["created_at"] for d in ds if d["status"] == "pending"]
        out[name] = {
            "deliveries": len(ds),
            **{s: sum(d["status"] == s for d in ds) for s in ("pending", "inflight", "acked", "dead")},
            "oldest_pending_age_s": (now - min(pending)).total_seconds() if pending else None,
            "latencies": sorted(latency_ms(d) for d in ds if d["status"] == "acked"),
        }
    return out


def within_rank(values, q, got, tolerance=0.01):
    """Whether `got` is a q-quantile of the sorted `values` to within `tolerance` of rank: a
    value at least the one at rank (q - tol) * n and at most the one at rank (q + tol) * n."""
    n = len(values)
    lo = values[max(math.floor((q - tolerance) * n) - 1, 0)]
    hi = values[min(math.ceil((q + tolerance) * n), n - 1)]
    return lo <= got <= hi


def assert_figures(result, expected):
    """`analyze --json`'s events (`result`) are the `expected` ones (expected_events, or
    tests.support.history_rows.expected_events): counts exact, percentiles within 1 % of rank."""
    got = {(e["queue"], e["event"]): e for e in result["events"]}
    assert got.keys() == expected.keys()
    for key, want in expected.items():
        row = got[key]
        for name in ("messages", "deliveries", "acked", "dead"):
            assert row[name] == want[name], (key, name)
        assert row["attempts_mean"] == pytest.approx(want["attempts_mean"]), key
        for q, name in ((0.5, "p50"), (0.95, "p95"), (0.99, "p99")):
            assert within_rank(want["latencies"], q, row["latency_ms"][name]), (key, name)
