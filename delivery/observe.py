"""The two latency histograms of /metrics, observed where publishes and acks happen.

- `mq_publish_duration_seconds{transport}`: from a publish call (a REST request's, a run of a
  socket's publish frames to one queue, the admin's test message) to its commit, waiting in a
  group commit included: what the publisher waits for. One observation per call, whatever the
  number of messages in it; a publish that fails is not observed.
- `mq_delivery_latency_seconds{queue}`: from a message's publish (or its `deliver_at`, when it
  asked to wait) to the ack of one delivery of it, by any transport (REST, socket, a webhook's
  success in the worker): one observation per delivery newly acked, in the ledger's ack
  statement (delivery.ledger._ack), as the dashboard's latency counts it.

Labels stay few: `transport` is one of TRANSPORTS, and `queue` names one of the queues, which
operators make (a subscriber cannot), so their number is the deployment's number of queues.

Kept cheap on the hot path: a child per label value is looked up once and kept, and an
observation is a bucket search and two writes to a memory-mapped file (mqsite.prometheus);
about a microsecond or two in-process (bench/observe_cost.py).
"""

import functools
import time
from contextlib import contextmanager

from django.db import connection
from prometheus_client import Histogram

from mqsite import adb, prometheus
from queues.models import Message, Queue

TRANSPORTS = ("rest", "websocket", "admin")

# Publish to commit: a millisecond on PostgreSQL, a few on SQLite's fsync; a group commit's
# wait or a loaded machine may make it seconds.
PUBLISH_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Publish to ack: milliseconds for a connected consumer, up to hours for a backlog or retries;
# 2 s is a bound, so that "p95 above 2 s" is read at a bucket's edge, not interpolated.
LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0, 3600.0, 21600.0
)  # fmt: skip

publish_duration = Histogram(
    "mq_publish_duration_seconds",
    "From a publish call to its commit, by transport (one observation per call).",
    ["transport"],
    buckets=PUBLISH_BUCKETS,
    registry=prometheus.LOCAL,
)
delivery_latency = Histogram(
    "mq_delivery_latency_seconds",
    "From a message's publish (or its deliver_at) to the ack of a delivery of it, by queue.",
    ["queue"],
    buckets=LATENCY_BUCKETS,
    registry=prometheus.LOCAL,
)

_by_transport = {}  # transport -> its histogram child
_by_queue = {}  # queue name -> its histogram child
# Queue id -> name, for the ack statement's rows: a queue's name never changes (the admin keeps
# it read-only: clients address it by name) and an id is never given again.
_queue_names = {}


def start_serving():
    """A web process's series of every transport, at zero from the start (rate() needs them)."""
    for transport in TRANSPORTS:
        _child(transport)


def _child(transport):
    child = _by_transport.get(transport)
    if child is None:
        child = _by_transport[transport] = publish_duration.labels(transport)
    return child


@contextmanager
def publishing(transport):
    """Around a publish call: observes its duration when it returns (not when it raises)."""
    started = time.perf_counter()
    yield
    _child(transport).observe(time.perf_counter() - started)


def ack_returning():
    return _ack_returning(connection.vendor)


@functools.cache
def _ack_returning(vendor):
    """The ack statement's RETURNING columns for acked_statement(): the queue, and the seconds
    from when the wait began to the ack (acked_at, the row's new value), as a float computed by
    the database (a timestamp per row cost the ack of 100 deliveries 10 % more, converted in
    Python). A delivery's created_at is its message's publish time; its message's deliver_at is
    read (a primary-key lookup) only where the delivery was not ready at once, since only then
    can there be one: every other delivery was made ready at its creation (next_attempt_at is
    created_at) and only a retry or a delay moves it."""
    message = Message._meta.db_table
    since = f"""CASE WHEN next_attempt_at > created_at
        THEN COALESCE((SELECT deliver_at FROM {message} WHERE {message}.id = message_id), created_at)
        ELSE created_at END"""
    if vendor == "postgresql":
        return f"queue_id, EXTRACT(EPOCH FROM acked_at - {since})::float8"
    return f"queue_id, (julianday(acked_at) - julianday({since})) * 86400.0"  # SQLite: UTC text


def name_queue(queue):
    """A queue this process publishes to: its acks here will need no query for its name."""
    if queue.pk not in _queue_names:
        _queue_names[queue.pk] = queue.name


def acked_statement(rows):
    """Observe the latency of newly acked deliveries (sans-I/O, for either driver): `rows` end
    with ack_returning()'s two columns. A queue not yet named in this process costs one query,
    once."""
    missing = {row[-2] for row in rows} - _queue_names.keys()
    if missing:
        of_ids, params = adb.one_of("id", sorted(missing))
        found = yield f"SELECT id, name FROM {Queue._meta.db_table} WHERE {of_ids}", params
        _queue_names.update(found)
    for row in rows:
        name = _queue_names.get(row[-2])
        if name is None:  # deleted since
            continue
        child = _by_queue.get(name)
        if child is None:
            child = _by_queue[name] = delivery_latency.labels(name)
        child.observe(max(row[-1], 0.0))  # an operator's early delivery: before its deliver_at
