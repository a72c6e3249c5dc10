"""Who would receive this (the API's Extensions): which subscriptions of a queue a message would
be owed to, and why each is or is not, without publishing it.

The answer comes from the fan-out's own rule (ledger.owed_clauses(), the clauses _OWED_JOIN()
joins, and subscribers.filters for each filter key), evaluated in one SELECT over the queue's
subscriptions with the candidate message as a row of parameters: the route cannot say "owed"
where a publish would not owe, or the reverse.
"""

from django.db import connection

from queues.models import Event, Queue
from subscribers.filters import clause_holds, filter_source, found_value
from subscribers.models import FilterClause, Subscriber, Subscription

from . import ledger

# The reasons, in the order they are looked for: the first clause that fails names it.
EVENT_DIFFERS = "event differs"
LEAVING = "being unsubscribed"
INACTIVE = "subscriber inactive"
NO_RIGHT = "no right to subscribe"
OWED = "owed"
HELD_SUBSCRIPTION = "owed, but held while the subscription is paused"
HELD_QUEUE = "owed, but held while the queue is paused"


def route(queue, outgoing, subscriber=None):
    """[{"id", "subscriber", "event", "matches", "reason"}] of the queue's subscriptions (only
    `subscriber`'s when given), in id order, for one prepared message (publishing.prepare).
    `matches`: a publish now would owe it to that subscription (a paused one is owed too: it
    is held, not skipped)."""
    event_id = Event.objects.filter(queue=queue, name=outgoing.event).values_list("pk", flat=True).first()
    owed = ledger.owed_clauses()
    # The candidate message, as the fan-out's `m` is: a row with what its clauses read.
    message = """(SELECT CAST(NULL AS bigint) AS id, CAST(%s AS bigint) AS queue_id,
            CAST(%s AS bigint) AS event_id, CAST(%s AS text) AS payload_json,
            CAST(%s AS text) AS headers_json) m"""
    mine = "s.subscriber_id = %s" if subscriber is not None else "TRUE"
    sql = f"""
        SELECT s.id, r.name, e.name, s.paused, q.paused,
            {owed["event"]}, {owed["staying"]}, {owed["active"]}, {owed["right"]}, {owed["filter"]},
            c.key, {clause_holds("c", "m")}, {found_value("c", "m")}
        FROM {filter_source(message, "TRUE")}
        JOIN {Subscription._meta.db_table} s ON s.queue_id = m.queue_id
        JOIN {Subscriber._meta.db_table} r ON r.id = s.subscriber_id
        JOIN {Queue._meta.db_table} q ON q.id = s.queue_id
        LEFT JOIN {Event._meta.db_table} e ON e.id = s.event_id
        LEFT JOIN {FilterClause._meta.db_table} c ON c.subscription_id = s.id
        WHERE {mine}
        ORDER BY s.id, c.id
    """
    params = [True, True, queue.pk, event_id, outgoing.payload_json, outgoing.headers_json]
    if subscriber is not None:
        params.append(subscriber.pk)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        rows = cursor.fetchall()
    answers, failing = {}, {}
    for sid, name, event, paused, queue_paused, *clauses, key, holds, found in rows:
        if sid not in answers:
            answers[sid] = (name, event, bool(paused), bool(queue_paused), [bool(c) for c in clauses])
        if key is not None and not holds and sid not in failing:
            failing[sid] = (key, found)  # the first key that fails, in the order it was given
    return [_answer(sid, *answers[sid], failing.get(sid)) for sid in answers]


def _answer(sid, name, event, paused, queue_paused, clauses, failing):
    of_event, staying, active, right, filtered = clauses
    matches = of_event and staying and active and right and filtered
    if not of_event:
        reason = EVENT_DIFFERS
    elif not staying:
        reason = LEAVING
    elif not active:
        reason = INACTIVE
    elif not right:
        reason = NO_RIGHT
    elif not filtered:
        key, found = failing or ("?", None)
        reason = f"filter key {key} is absent" if found is None else f"filter key {key} has {found}"
    elif paused:
        reason = HELD_SUBSCRIPTION
    elif queue_paused:
        reason = HELD_QUEUE
    else:
        reason = OWED
    return {"id": sid, "subscriber": name, "event": event, "matches": matches, "reason": reason}
