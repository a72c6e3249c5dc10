"""Publishing: check a message, give it the queue's next seq, store it and fan it out.

`publish()` may be called inside the caller's own transaction: the message exists if and
only if that transaction commits, and subscribers are woken only after it does.
"""

import json
from collections import Counter
from dataclasses import dataclass, field, replace

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from mqsite import adb, bus, limits
from mqsite.names import BadName, clean_name
from mqsite.values import storable_text
from queues import schemas
from queues import timing as timings
from queues.headers import BadHeaders, encode_headers
from queues.models import Event, Message, Queue

from . import inline, ledger, observe

MAX_BATCH = 1000
MAX_KEY_LENGTH = 255
MAX_GROUP_LENGTH = 128


class BadMessage(ValueError):
    """A message that cannot be published as given (the caller answers 400)."""


class PayloadTooLarge(BadMessage):
    """A payload over MQ_MAX_PAYLOAD_BYTES (the caller answers 413)."""


class BadMessageHeaders(BadMessage):
    """Headers that break a rule of queues.headers (the caller answers 400 naming `headers`)."""


class BadMessageTiming(BadMessage):
    """A deliver_at / delay_secs / expires_at / ttl_secs that breaks a rule of queues.timing
    (the caller answers 400 with `code`, naming `field`)."""

    def __init__(self, exc):
        super().__init__(exc.detail)
        self.code, self.field = exc.code, exc.field


class BadMessageGroup(BadMessage):
    """A group that is not a string of 1 to MAX_GROUP_LENGTH characters (400 naming `group`)."""


class SchemaMismatch(BadMessage):
    """Payloads that fail their event's schema (queues.schemas): nothing of the publish is
    written. `errors` lists the failures as [{"index", "path", "message"}], `index` being the
    message's place in what was published (0 for a single message), `path` a JSON pointer
    into its payload; at most schemas.MAX_ERRORS of them."""

    code = "schema_mismatch"

    def __init__(self, errors):
        self.errors = errors
        where = ", ".join(str(i) for i in sorted({e["index"] for e in errors}))
        super().__init__(
            f"A payload does not satisfy its event's schema (message {where}); nothing was published."
        )


_UNPARSED = object()  # an Outgoing made from text alone: its payload is parsed if a schema asks


@dataclass(frozen=True)
class Outgoing:
    event: str
    payload_json: str
    key: str | None
    publisher: object = None  # a Subscriber; publish()'s `publisher` fills it in when None
    headers_json: str | None = None  # None: no headers (queues.headers)
    receipt: bool = False  # the publisher waits for a receipt (delivery.receipts)
    # When it falls due and expires, as sent (queues.timing; its queue's default TTL is added
    # at publish: timing_in).
    timing: timings.Timing = timings.NO_TIMING
    group: str | None = None  # its message group (delivery.lines); None: the default group
    # The payload as sent, for its event's schema (prepare() has it: no second parse).
    payload: object = field(default=_UNPARSED, compare=False, repr=False)

    def payload_value(self):
        return json.loads(self.payload_json) if self.payload is _UNPARSED else self.payload


def timing_fields(item):
    """The deliver_at, delay_secs, expires_at and ttl_secs of a publish item (a dict), for
    prepare(): absent ones None."""
    return {f: item.get(f) for f in timings.FIELDS}


def prepare(event, payload, key=None, headers=None, group=None, **times):
    """Check one message and encode its payload and headers; BadMessage says what is wrong
    (BadMessageHeaders when it is the headers, BadMessageGroup when it is the group,
    BadMessageTiming when it is `times`: any of deliver_at, delay_secs, expires_at and ttl_secs,
    queues.timing). `group`: its message group, a string of 1 to MAX_GROUP_LENGTH characters,
    or None."""
    try:
        event = clean_name(event, "event")
    except BadName as exc:
        raise BadMessage(str(exc)) from None
    if key is not None:
        if not isinstance(key, str) or not key or len(key) > MAX_KEY_LENGTH:
            raise BadMessage(f"key must be a non-empty string of at most {MAX_KEY_LENGTH} characters")
        # Databases cannot store NUL in text, nor a lone surrogate as UTF-8: refuse, don't fail.
        if not storable_text(key):
            raise BadMessage("key may not contain NUL or invalid Unicode")
    if group is not None:
        if not isinstance(group, str) or not group or len(group) > MAX_GROUP_LENGTH:
            raise BadMessageGroup(
                f"group must be a non-empty string of at most {MAX_GROUP_LENGTH} characters"
            )
        if not storable_text(group):
            raise BadMessageGroup("group may not contain NUL or invalid Unicode")
    try:
        # allow_nan=False: NaN and Infinity are not JSON, and other clients could not read them.
        text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise BadMessage("payload holds text that is not valid Unicode (a lone surrogate)") from None
    except (TypeError, ValueError) as exc:
        raise BadMessage(f"payload is not JSON: {exc}") from None
    if size > settings.MQ_MAX_PAYLOAD_BYTES:
        raise PayloadTooLarge(
            f"payload is {size} bytes of JSON, over the limit of {settings.MQ_MAX_PAYLOAD_BYTES}"
        )
    try:
        headers_json = encode_headers(headers)
    except BadHeaders as exc:
        raise BadMessageHeaders(str(exc)) from None
    try:
        when = timings.timing_of(**times) if times else timings.NO_TIMING
    except timings.BadTiming as exc:
        raise BadMessageTiming(exc) from None
    return Outgoing(event, text, key, headers_json=headers_json, payload=payload, group=group, timing=when)


def timing_in(queue, outgoing, now):
    """Each message's (deliver_at, expires_at) as it is stored when published at `now`: its
    own, with its queue's default TTL where it names no expiry (queues.timing.stored_times)."""
    return [timings.stored_times(o.timing, now, queue.ttl_secs) for o in outgoing]


def check_schemas(queue, outgoing):
    """Raise SchemaMismatch when a payload fails its event's schema. Before anything is
    written, and before a publish joins others (group_commit): one caller's bad payload
    never fails another's publish."""
    _raise_mismatch(outgoing, {n: schemas.validator_of(queue.pk, n) for n in {o.event for o in outgoing}})


async def acheck_schemas(queue, outgoing):
    """check_schemas() from the event loop."""
    validators = {n: await schemas.avalidator_of(queue.pk, n) for n in {o.event for o in outgoing}}
    _raise_mismatch(outgoing, validators)


def _raise_mismatch(outgoing, validators):
    if not any(validators.values()):  # the usual publish: no schema, nothing to parse
        return
    errors = []
    for index, o in enumerate(outgoing):
        validator = validators[o.event]
        if validator is not None:
            room = schemas.MAX_ERRORS - len(errors)
            found = validator.errors(o.payload_value())
            errors += [{"index": index, **e} for e in found[:room]]
            if len(errors) >= schemas.MAX_ERRORS:
                break
    if errors:
        raise SchemaMismatch(errors)


def publish(queue, outgoing, publisher=None, checked=False):
    """Publish prepared messages to `queue`, all or nothing. Their payloads are checked against
    their events' schemas first (SchemaMismatch), unless the caller did (`checked`).

    Returns [(answer, created)] in the given order: the answer as the REST API gives it, and
    whether the message is new (False: its idempotency key was already used in this queue,
    and the answer is that first message's).
    """
    if not outgoing:
        return []
    observe.name_queue(queue)
    if not checked:
        check_schemas(queue, outgoing)
    try:
        return _publish(queue, outgoing, publisher)
    except IntegrityError:
        # A remembered event deleted since: look them up again (outside a caller's own
        # transaction, which is broken now and must fail as it is).
        if not _forget_events(queue.pk) or connection.in_atomic_block:
            raise
        return _publish(queue, outgoing, publisher)


def _publish(queue, outgoing, publisher):
    now = timezone.now()
    if connection.vendor == "postgresql" and all(o.key is None for o in outgoing):
        return _publish_at_once(queue, outgoing, publisher, now)
    with transaction.atomic():
        events = _events(queue, {o.event for o in outgoing}, outgoing, publisher)
        keys = [o.key for o in outgoing if o.key is not None]
        existing = {}
        if keys:
            # Lock the queue row before looking the keys up: two publishers of one key both
            # seeing it absent would both insert (and one would fail on the unique index).
            # NO KEY UPDATE, like the UPDATE of last_seq below: it serialises publishers, and
            # lets others check foreign keys to the queue meanwhile (FOR UPDATE would not, and
            # a lease checking them at its commit while holding a subscription row that this
            # publish checks at its own commit would deadlock with it).
            Queue.objects.select_for_update(no_key=True).filter(pk=queue.pk).values_list("pk").first()
            existing = {
                m.key: m for m in Message.objects.filter(queue=queue, key__in=keys).select_related("event")
            }
            # A receipt asked by a retry marks the message its key found, if the message is the
            # caller's: another publisher's repeat of the key learns and changes nothing of it.
            again = {
                m.pk
                for o in outgoing
                if o.receipt and (m := existing.get(o.key)) is not None and _publisher_of(m, o, publisher)
            }
            if again - {m.pk for m in existing.values() if m.receipt_wanted}:
                ledger.want_receipts(again)
        # Each message either is new or repeats a key: already in the queue, or earlier in
        # this batch. slots[i] says which message answers outgoing[i], and whether it is new.
        new, slots, by_key = [], [], {}
        for o in outgoing:
            if o.key is not None and o.key in by_key:
                ref = by_key[o.key]
                if (
                    o.receipt
                    and isinstance(ref, int)
                    and not new[ref].receipt
                    and _same_publisher(new[ref], o, publisher)
                ):
                    new[ref] = replace(new[ref], receipt=True)  # its publisher's retry in the batch
                slots.append((ref, False))
                continue
            if o.key is not None and o.key in existing:
                ref = existing[o.key]
            else:
                ref = len(new)
                new.append(o)
            if o.key is not None:
                by_key[o.key] = ref
            slots.append((ref, isinstance(ref, int)))
        messages = []
        if new:
            first_seq = _take_seqs(queue, len(new))
            times = timing_in(queue, new, now)
            messages = Message.objects.bulk_create(
                Message(
                    queue=queue,
                    event=events[o.event],
                    seq=first_seq + i,
                    payload_json=o.payload_json,
                    headers_json=o.headers_json,
                    key=o.key,
                    publisher=o.publisher or publisher,
                    created_at=now,
                    receipt_wanted=o.receipt,
                    deliver_at=times[i][0],
                    expires_at=times[i][1],
                    group=o.group,
                )
                for i, o in enumerate(new)
            )
            receipt = any(o.receipt for o in new)
            counts, owed = ledger.fan_out(
                queue.pk, first_seq, first_seq + len(new) - 1, now, receipt, ordered=queue.ordered
            )
            for m in messages:
                m.delivery_count = counts.get(m.pk, 0)
            bus.send_after_commit(bus.WAKE, owed)
        for m in existing.values():
            m.delivery_count = m.deliveries.count()
    return [
        (_answer(messages[ref] if isinstance(ref, int) else ref, queue), created) for ref, created in slots
    ]


def _publisher_of(message, o, publisher):
    """Whether this message (stored) is the publisher's of outgoing `o` (an operator's is nobody's)."""
    mine = o.publisher or publisher
    return mine is not None and message.publisher_id == mine.pk


def _same_publisher(a, b, publisher):
    """Whether two outgoing messages of one batch (group_commit's: of several callers) are one
    subscriber's; an operator's are nobody's."""
    a, b = a.publisher or publisher, b.publisher or publisher
    return a is not None and b is not None and a.pk == b.pk


def _publish_at_once(queue, outgoing, publisher, now):
    """The same publish as one statement (PostgreSQL, no idempotency keys, which need a look
    first): take the seqs, insert the messages and fan them out. Outside a caller's transaction
    that is one round trip and one commit, where the steps above took six (bench/PROFILE.md).
    The UPDATE of last_seq still locks the queue row until the commit, as _take_seqs does."""
    events = _events(queue, {o.event for o in outgoing}, outgoing, publisher)
    answers, owed, _ = adb.run_sync(_publish_statement(queue, outgoing, publisher, now, events))
    bus.send_after_commit(bus.WAKE, owed)
    return answers


async def apublish(queue, outgoing, publisher=None, checked=False):
    """publish() from the event loop. In the services mode, without idempotency keys and with
    every event known (the usual publish), it is _publish_at_once's one statement on the async
    connection, in autocommit: the answers come back after its commit, the wake-ups go after
    it. Otherwise (keys need a look and a lock first, a new event is made and counted against
    the limits, SQLite) it is publish() in a thread.

    On this path the sockets of this process with room take their deliveries in the statement
    itself (delivery.inline): sent after the commit, and woken by no wake-up."""
    if not outgoing:
        return []
    observe.name_queue(queue)
    if not checked:
        await acheck_schemas(queue, outgoing)
    events = _remembered_events(queue, {o.event for o in outgoing})
    if not adb.enabled() or events is None or any(o.key is not None for o in outgoing):
        return await adb.thread(publish)(queue, outgoing, publisher=publisher, checked=True)
    seats = inline.take(queue, len(outgoing))
    try:
        answers, owed, taken = await adb.run(
            _publish_statement(queue, outgoing, publisher, timezone.now(), events, seats)
        )
    except IntegrityError:
        inline.cancel(seats)
        # A remembered event deleted since (the admin): publish() looks them up again.
        _forget_events(queue.pk)
        return await adb.thread(publish)(queue, outgoing, publisher=publisher, checked=True)
    except BaseException:
        # Committed or not, a seat's socket must not wait for it: what it may have been given
        # is in flight to it in the ledger, and comes back when it closes or at its deadline.
        inline.cancel(seats)
        raise
    inline.hand_over(seats, taken)
    bus.send(bus.WAKE, owed)
    return answers


def _publish_statement(queue, outgoing, publisher, now, events, seats=()):
    """_publish_at_once's statement, for either driver (mqsite/adb.py): (the answers, the
    subscribers owed something, {holder: [(subscription id, delivery)]} of what `seats`
    (delivery.inline) took, as a lease describes it)."""
    count = len(outgoing)
    at = connection.ops.adapt_datetimefield_value(now)
    # A publish that wants no receipt sends the statement it always did (the column's default);
    # so does one of messages neither delayed nor expiring.
    receipt = any(o.receipt for o in outgoing)
    times = timing_in(queue, outgoing, now)
    timed = any(t != (None, None) for t in times)
    if seats:
        # The queue's settings as its row is now: the UPDATE below waits for a pause under way.
        settings_of_q, seated = ", ordered, paused, ack_timeout", ("q", [], *inline.statement_seats(seats))
        fan_out, fan_out_params = ledger.fan_out_statement(
            "m", "TRUE", now, receipt, seats=seated, timed=timed, ordered=queue.ordered
        )
        result = """SELECT id, seq, NULL::bigint, NULL::bigint, NULL::text, NULL::timestamptz,
                NULL::integer, NULL::bigint FROM m
            UNION ALL SELECT message_id, NULL::bigint, subscriber_id, id, lease_holder, ack_deadline,
                attempt, subscription_id FROM d"""
    else:
        settings_of_q = ""
        fan_out, fan_out_params = ledger.fan_out_statement(
            "m", "TRUE", now, receipt, timed=timed, ordered=queue.ordered
        )
        result = """SELECT id, seq, NULL::bigint FROM m
            UNION ALL SELECT message_id, NULL::bigint, subscriber_id FROM d"""
    wanted = (", receipt_wanted", ", v.receipt", ", %s::boolean[]", ", receipt") if receipt else ("",) * 4
    if timed:
        wanted = (
            f"{wanted[0]}, deliver_at, expires_at",
            f"{wanted[1]}, v.deliver_at, v.expires_at",
            f"{wanted[2]}, %s::timestamptz[], %s::timestamptz[]",
            f"{wanted[3]}, deliver_at, expires_at",
        )
    # Groups only when some message names one, and returned for the fan-out of an ordered
    # queue (its lines): other publishes send the statement they always did.
    grouped = any(o.group is not None for o in outgoing)
    named = (", grp", ", v.grp", ", %s::text[]", ", grp") if grouped else ("",) * 4
    returned = ", grp" if queue.ordered else ""
    sql = f"""
        WITH q AS (
            UPDATE {Queue._meta.db_table} SET last_seq = last_seq + %s WHERE id = %s
            RETURNING last_seq - %s AS base{settings_of_q}
        ), m AS (
            INSERT INTO {Message._meta.db_table}
                (queue_id, event_id, seq, payload_json, headers_json, key, publisher_id,
                 created_at{wanted[0]}{named[0]})
            SELECT %s, v.event_id, q.base + v.n, v.payload_json, v.headers_json, NULL, v.publisher_id,
                %s{wanted[1]}{named[1]}
            FROM q, unnest(%s::bigint[], %s::text[], %s::text[], %s::bigint[]{wanted[2]}{named[2]})
                WITH ORDINALITY
                AS v (event_id, payload_json, headers_json, publisher_id{wanted[3]}{named[3]}, n)
            RETURNING id, queue_id, event_id, seq, payload_json, headers_json{wanted[0]}{returned}
        ), d AS ({fan_out})
        {result}
    """
    params = [
        count,
        queue.pk,
        count,
        queue.pk,
        at,
        [events[o.event].pk for o in outgoing],
        [o.payload_json for o in outgoing],
        [o.headers_json for o in outgoing],
        [p.pk if (p := o.publisher or publisher) is not None else None for o in outgoing],
        *([[o.receipt for o in outgoing]] if receipt else []),
        *([[t[0] for t in times], [t[1] for t in times]] if timed else []),
        *([[o.group for o in outgoing]] if grouped else []),
        *fan_out_params,
    ]
    rows = yield sql, params
    made = sorted((row[1], row[0]) for row in rows if row[1] is not None)  # seq order is input order
    deliveries = [row for row in rows if row[1] is None]
    counts, owed = ledger.fanned_out([(row[0], row[2]) for row in deliveries])
    answers = [
        (_answer_of(id_, queue, o.event, seq, counts.get(id_, 0), now), True)
        for (seq, id_), o in zip(made, outgoing, strict=True)
    ]
    taken = {}
    if seats:
        messages = {id_: (seq, o, t) for (seq, id_), o, t in zip(made, outgoing, times, strict=True)}
        owed = {row[2] for row in deliveries if not row[4]}  # a seated subscriber needs no wake-up
        for message_id, _, _, id_, holder, ack_deadline, attempt, subscription_id in deliveries:
            if holder:
                seq, o, t = messages[message_id]
                # Its frame, from what the publisher sent: the row would only say it again.
                delivery = ledger.describe_row(
                    id_,
                    message_id,
                    queue.name,
                    o.event,
                    seq,
                    o.payload_json,
                    attempt,
                    now,
                    ack_deadline,
                    o.headers_json,
                    None,  # a delayed message is never seated (ledger._fan_out_seated)
                    t[1],  # its expires_at
                    o.group,
                )
                taken.setdefault(holder, []).append((subscription_id, delivery))
    return answers, owed, taken


# Events of a queue, by (queue id, name), as committed: a row never changes its name or queue,
# so a publish need not look its event up each time (the lookup was about a seventh of a
# single publish's cost). Filled only after a commit, so that a rolled-back transaction leaves
# nothing here; an event deleted since (the admin) fails the publish's foreign key at commit,
# and publish() forgets the queue's events and tries again.
_known_events = {}
KNOWN_EVENTS_MAX = 10_000


def _events(queue, names, outgoing=(), publisher=None):
    """The queue's Event rows for these names, made where missing (race-safe). A subscriber's
    new names count against its hourly cap first (mqsite.limits): refused, nothing is made."""
    found = {n: e for n in names if (e := _known_events.get((queue.pk, n))) is not None}
    missing = names - found.keys()
    if missing:
        looked_up = {e.name: e for e in Event.objects.filter(queue=queue, name__in=missing)}
        if missing - looked_up.keys():
            _charge_new_events(missing - looked_up.keys(), outgoing, publisher)
            Event.objects.bulk_create(
                [Event(queue=queue, name=n) for n in missing - looked_up.keys()], ignore_conflicts=True
            )
            looked_up = {e.name: e for e in Event.objects.filter(queue=queue, name__in=missing)}
        found.update(looked_up)
        transaction.on_commit(lambda: _remember_events(queue.pk, looked_up.values()))
    return found


def _remembered_events(queue, names):
    """The queue's Event rows for these names when all are remembered, else None."""
    found = {n: _known_events.get((queue.pk, n)) for n in names}
    return None if None in found.values() else found


def _charge_new_events(names, outgoing, publisher):
    """Each new name counts for the subscriber whose message names it first; an operator's
    publish (no subscriber) counts for nobody."""
    makers = {}
    for o in outgoing:
        if o.event in names and o.event not in makers:
            makers[o.event] = o.publisher or publisher
    counts = Counter(m.pk for m in makers.values() if m is not None)
    if counts:
        limits.charge_new_events(counts)


def _remember_events(queue_id, events):
    if len(_known_events) > KNOWN_EVENTS_MAX:
        _known_events.clear()
    for e in events:
        _known_events[(queue_id, e.name)] = e


def forget_all_events():
    _known_events.clear()


def _forget_events(queue_id):
    """Drop the remembered events of a queue; whether there were any."""
    keys = [k for k in list(_known_events) if k[0] == queue_id]
    for k in keys:
        _known_events.pop(k, None)
    return bool(keys)


def _take_seqs(queue, count):
    """Reserve `count` seqs of the queue; returns the first.

    The UPDATE locks the queue row until commit, so publishers of one queue commit in seq
    order: a reader that has seen seq n never later finds a newly committed seq below n.
    """
    table = Queue._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {table} SET last_seq = last_seq + %s WHERE id = %s RETURNING last_seq",
            [count, queue.pk],
        )
        last = cursor.fetchone()[0]
    return last - count + 1


def _answer(message, queue):
    return _answer_of(
        message.pk, queue, message.event.name, message.seq, message.delivery_count, message.created_at
    )


def _answer_of(id_, queue, event, seq, deliveries, created_at):
    """A published message as the REST API answers it."""
    return {
        "id": id_,
        "queue": queue.name,
        "event": event,
        "seq": seq,
        "deliveries": deliveries,
        "created_at": created_at,
    }
