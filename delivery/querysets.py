"""The read model of deliveries: each rule for reading them, written once.

Ready, retrying, overdue, open, unsettled, the heads of ordered subscriptions and the backlog:
the ledger, the tasks, the reports and the admin read deliveries through these, never through
a condition of their own. A rule that the ledger's raw statements also need is written here in
each spelling, side by side: a Q (a filter, or an aggregate's filter=), an SQL fragment (the
hot statements are raw SQL, bench/PROFILE.md), and a test of a row already read (the model's
methods).

A status that a partial index's condition names is written as one term per status: the ORM's
`status = %s` (or, in raw SQL, the literal of status_is) rather than an IN list, so that each
term can use the partial index of its status (delivery.models).
"""

from django.db.models import Count, Max, Min, Q, QuerySet

from .statuses import Status

# Still to be handed out or acknowledged.
OPEN = (Status.PENDING, Status.INFLIGHT)
# Not acked yet: open, or given up on (dead).
UNSETTLED = (Status.PENDING, Status.INFLIGHT, Status.DEAD)


def status_is(status, alias="d"):
    """SQL: the delivery `alias` is in `status`, the status written as a literal. Where a partial
    index (delivery.models) should serve a statement, its status must be a literal as in the
    index's condition: the planner cannot prove a parameter's value matches it in a generic plan
    (PostgreSQL's prepared statements), nor SQLite inside an IN list."""
    return f"{alias}.status = '{Status(status).value}'"


# --- ready: pending, due now (next_attempt_at is not in the future), and not expired -----------
# A delivery whose expires_at has passed is never handed out: the sweep makes it dead
# ("expired", ledger.expire_overdue_leases); until then it is simply not ready, and an ordered
# line's head skips it (unexpired_sql), so that it holds up nothing behind it.


def ready_q(now):
    return Q(status=Status.PENDING, next_attempt_at__lte=now) & unexpired_q(now)


def ready_sql(alias="d"):
    """ready_q in SQL on the delivery `alias`; its two parameters are `now`, twice. Reads
    delivery_ready (a subscription's) or delivery_due (a subscriber's), both partial on pending."""
    return f"{status_is(Status.PENDING, alias)} AND {alias}.next_attempt_at <= %s AND {unexpired_sql(alias)}"


def is_ready(status, next_attempt_at, now, expires_at=None):
    return status == Status.PENDING and next_attempt_at <= now and not is_expired(expires_at, now)


# --- expired: its message's expiry passed (queues.timing); dead at the end of what it is doing --


def unexpired_q(now):
    return Q(expires_at__isnull=True) | Q(expires_at__gt=now)


def unexpired_sql(alias="d"):
    """SQL: the delivery `alias` has not expired; its one parameter is `now`."""
    return f"({alias}.expires_at IS NULL OR {alias}.expires_at > %s)"


def expired_sql(alias="d"):
    """SQL: the delivery `alias` has expired (its one parameter, `now`). Pending ones by
    delivery_expiring (partial on pending with an expiry: the IS NOT NULL matches its condition)."""
    return f"{alias}.expires_at IS NOT NULL AND {alias}.expires_at <= %s"


def is_expired(expires_at, now):
    return expires_at is not None and expires_at <= now


# --- retrying: pending, but not before next_attempt_at (a nack, a failed push, a lost lease) -----


def retrying_q(now):
    return Q(status=Status.PENDING, next_attempt_at__gt=now)


def is_retrying(status, next_attempt_at, now):
    return status == Status.PENDING and next_attempt_at > now


# --- overdue: in flight, its ack deadline reached: the sweeper and leases expire it -------------


def overdue_q(now):
    return Q(status=Status.INFLIGHT, ack_deadline__lte=now)


def overdue_sql(alias="d"):
    """overdue_q in SQL on the delivery `alias`; its one parameter is `now`. Reads
    delivery_overdue (partial on in flight)."""
    return f"{status_is(Status.INFLIGHT, alias)} AND {alias}.ack_deadline <= %s"


def is_overdue(status, ack_deadline, now):
    return status == Status.INFLIGHT and ack_deadline is not None and ack_deadline <= now


# --- open, unsettled -----------------------------------------------------------------------------


def open_q():
    """Pending or in flight, one term per status: each can use its status's partial index."""
    return Q(status=Status.PENDING) | Q(status=Status.INFLIGHT)


def open_in_sql(alias="d"):
    """Open in SQL as one IN list of literals: the spelling of delivery_receipt_open's
    condition, which a statement must repeat for SQLite (it matches the terms as written) and
    PostgreSQL's generic plans to use that index."""
    literals = ", ".join(f"'{status.value}'" for status in OPEN)
    return f"{alias}.status IN ({literals})"


def line_position(status, seq):
    """Where an open delivery stands in its ordered subscription's line (the lowest is the
    head): the one in flight first, whatever its seq (a seek or a redelivery may reopen lower
    seqs behind it, and they wait for it; only one is ever in flight), then pending by seq."""
    return (status != Status.INFLIGHT, seq)


# The groupings backlog() knows, and the column each groups by.
BACKLOG_BY = {
    "subscriber": "subscriber_id",
    "queue": "queue_id",
    "event": "event_id",
    "subscription": "subscription_id",
}


class DeliveryQuerySet(QuerySet):
    """Delivery.objects: the read predicates as methods, chainable with any filter."""

    def ready(self, now):
        """Pending and due at `now`: what a lease may hand out."""
        return self.filter(ready_q(now))

    def retrying(self, now):
        """Pending but not due yet at `now`: waiting for a retry."""
        return self.filter(retrying_q(now))

    def overdue(self, now):
        """In flight with its ack deadline reached at `now`: for expiry."""
        return self.filter(overdue_q(now))

    def open(self):
        """Pending or in flight."""
        return self.filter(open_q())

    def unsettled(self):
        """Not acked yet: pending, in flight or dead. One IN list: its readers group over
        delivery_by_subscriber or the message key, full indexes, where an IN list is fine."""
        return self.filter(status__in=UNSETTLED)

    def heads(self):
        """The heads of ordered subscriptions' lines among these deliveries: per subscription
        of an ordered queue and message group (its line, delivery.lines), the open delivery
        that holds it: the one in flight, else the lowest-seq pending one. Marked on the row
        (`head`, kept by triggers), so this reads the marks, not the backlogs: the pending
        ones by delivery_heads, the open ones by the unique delivery_one_head_per_line."""
        return self.filter(head=True, grp__isnull=False).filter(status__in=OPEN)

    def backlog(self, *by, now=None):
        """The unsettled deliveries among these, grouped by `by` (any of BACKLOG_BY: subscriber,
        queue, event, subscription): one row per group, as a dict of the group's columns
        (`subscriber_id`, ...) and `pending`, `inflight`, `dead` and `oldest_pending_at` (when
        the oldest pending one was published; None if none is). With `now`, also when their
        waits end: `retrying` (pending, not due yet), `next_retry_at` (the earliest of those)
        and `inflight_until` (the latest ack deadline). One grouped statement."""
        columns = [BACKLOG_BY[b] for b in by]
        figures = {
            "pending": Count("pk", filter=Q(status=Status.PENDING)),
            "inflight": Count("pk", filter=Q(status=Status.INFLIGHT)),
            "dead": Count("pk", filter=Q(status=Status.DEAD)),
            "oldest_pending_at": Min("created_at", filter=Q(status=Status.PENDING)),
        }
        if now is not None:
            figures |= {
                "retrying": Count("pk", filter=retrying_q(now)),
                "next_retry_at": Min("next_attempt_at", filter=retrying_q(now)),
                "inflight_until": Max("ack_deadline", filter=Q(status=Status.INFLIGHT)),
            }
        # order_by(): the model's default ordering would otherwise split the groups.
        return self.unsettled().order_by().values(*columns).annotate(**figures)
