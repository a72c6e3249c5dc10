"""A Hypothesis state machine over the ledger: random publish (delayed, expiring or not),
subscribe, unsubscribe, pause, resume, lease, ack (and an ordered line's next heads after it),
nack, lease extension, the sweep and the passing of time, checked after every step against a
plain model.

What must hold: no delivery is lost (every message reaches every subscription that existed
when it was published, until it is acked, dies or the subscription goes, paused or not); none
is leased to two holders at once; none is acked by a subscriber that does not own it; an
ordered subscription is handed its messages in seq order, one at a time, per message group
(messages name group g1, g2 or none, the default group); nothing of a paused subscription is
handed out, and once resumed everything it is owed is; nothing is handed out before its
deliver_at or after its message expired, and an expired message holds its line only until the
sweep makes it dead.
"""

from datetime import timedelta

import pytest
from django.utils import timezone
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from dashboard import snapshot
from delivery import ledger, publishing, subscribing, tallies
from delivery.models import Delivery, Status
from queues.models import Message, Queue
from subscribers.models import Subscriber, Subscription
from subscribers.provisioning import create_subscriber
from tests.support.recount import recount

QUEUES = {"plain": False, "fifo": True}
EVENTS = ["create", "delete"]
SUBSCRIBERS = ["alice", "bob"]
GROUPS = [None, "g1", "g2"]
MAX_ATTEMPTS = 3
ACK_TIMEOUT = 10


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        for model in (Delivery, Message, Subscription, Subscriber, Queue):
            model.objects.all().delete()
        self.queues = {
            name: Queue.objects.create(
                name=name, ordered=ordered, max_attempts=MAX_ATTEMPTS, ack_timeout=ACK_TIMEOUT
            )
            for name, ordered in QUEUES.items()
        }
        self.subscribers = {
            name: create_subscriber(name, publish=["*"], subscribe=["*"])[0] for name in SUBSCRIBERS
        }
        self.now = timezone.now() + timedelta(seconds=1)
        # The model: what each live subscription is owed, and who holds what.
        self.owed = {}  # subscription id -> set of message ids not yet acked (or dead)
        self.subscription_of = {}  # subscription id -> (subscriber name, queue name, event or None)
        self.held = {}  # delivery id -> (holder subscriber name, deadline)
        self.last_leased_seq = {}  # (ordered subscription id, group) -> highest seq handed out so far
        self.dead = set()  # delivery ids
        self.paused = set()  # subscription ids

    # --- rules ---

    @rule(
        who=st.sampled_from(SUBSCRIBERS),
        queue=st.sampled_from(list(QUEUES)),
        event=st.sampled_from(EVENTS + [None]),
    )
    def subscribe(self, who, queue, event):
        sub, created = subscribing.subscribe(self.subscribers[who], self.queues[queue], event)
        if created:
            self.owed[sub.pk] = set()
            self.subscription_of[sub.pk] = (who, queue, event)

    @precondition(lambda self: self.owed)
    @rule(data=st.data())
    def unsubscribe(self, data):
        sub_id = data.draw(st.sampled_from(sorted(self.owed)))
        subscribing.unsubscribe(Subscription.objects.get(pk=sub_id))
        del self.owed[sub_id]
        del self.subscription_of[sub_id]
        self.paused.discard(sub_id)
        self.last_leased_seq = {k: v for k, v in self.last_leased_seq.items() if k[0] != sub_id}
        live = set(Delivery.objects.values_list("id", flat=True))
        self.held = {d: h for d, h in self.held.items() if d in live}

    @precondition(lambda self: self.owed)
    @rule(data=st.data())
    def pause(self, data):
        sub_id = data.draw(st.sampled_from(sorted(self.owed)))
        changed = subscribing.pause(Subscription.objects.filter(pk=sub_id))
        assert changed == ([] if sub_id in self.paused else [sub_id]), "pausing is not idempotent"
        self.paused.add(sub_id)

    @precondition(lambda self: self.paused)
    @rule(data=st.data())
    def resume(self, data):
        sub_id = data.draw(st.sampled_from(sorted(self.paused)))
        assert subscribing.resume(Subscription.objects.filter(pk=sub_id)) == [sub_id]
        assert subscribing.resume(Subscription.objects.filter(pk=sub_id)) == []
        self.paused.discard(sub_id)

    @rule(
        queue=st.sampled_from(list(QUEUES)),
        items=st.lists(st.tuples(st.sampled_from(EVENTS), st.sampled_from(GROUPS)), min_size=1, max_size=4),
        delay=st.sampled_from([None, None, 5, 40]),
        ttl=st.sampled_from([None, None, 5, 60]),
    )
    def publish(self, queue, items, delay, ttl):
        events = [e for e, _ in items]
        times = {}
        if delay is not None:  # from the machine's clock, which runs ahead of the real one
            times["deliver_at"] = (self.now + timedelta(seconds=delay)).isoformat()
        if ttl is not None:
            times["ttl_secs"] = ttl
        batch = [publishing.prepare(e, {"e": e}, group=g, **times) for e, g in items]
        answers = publishing.publish(self.queues[queue], batch)
        for (answer, created), event in zip(answers, events, strict=True):
            assert created
            expected = 0
            for sub_id, (_, q, ev) in self.subscription_of.items():
                if q == queue and ev in (None, event):
                    self.owed[sub_id].add(answer["id"])
                    expected += 1
            assert answer["deliveries"] == expected

    @rule(who=st.sampled_from(SUBSCRIBERS), limit=st.integers(1, 5))
    def lease(self, who, limit):
        leased = ledger.lease_deliveries(self.subscribers[who], limit=limit, now=self.now)
        self._check_leased(who, leased, limit)

    def _check_leased(self, who, leased, limit):
        assert len(leased) <= limit
        for d in leased:
            held = self.held.get(d["id"])
            assert held is None or held[1] <= self.now, f"delivery {d['id']} leased twice at once"
            row = Delivery.objects.select_related("message").get(pk=d["id"])
            assert self.subscription_of[row.subscription_id][0] == who
            due = row.message.deliver_at
            assert due is None or due <= self.now, "handed out before its deliver_at"
            expires = row.message.expires_at
            assert expires is None or expires > self.now, "handed out after its message expired"
            assert row.subscription_id not in self.paused, "handed out while its subscription is paused"
            assert d["message_id"] in self.owed[row.subscription_id]
            assert d["group"] == Message.objects.get(pk=d["message_id"]).group
            self.held[d["id"]] = (who, self.now + timedelta(seconds=ACK_TIMEOUT))
            if self.queues[d["queue"]].ordered:
                line = (row.subscription_id, d["group"])
                open_seqs = Delivery.objects.filter(
                    subscription_id=row.subscription_id,
                    grp=d["group"] or "",
                    status__in=[Status.PENDING, Status.INFLIGHT],
                ).values_list("seq", flat=True)
                assert d["seq"] == min(open_seqs), "an ordered group skipped its head"
                assert d["seq"] >= self.last_leased_seq.get(line, 0)
                self.last_leased_seq[line] = d["seq"]
        ordered_lines = [
            (Delivery.objects.get(pk=d["id"]).subscription_id, d["group"])
            for d in leased
            if d["queue"] == "fifo"
        ]
        assert len(ordered_lines) == len(set(ordered_lines)), "two of one ordered group at once"

    @precondition(lambda self: self.held)
    @rule(who=st.sampled_from(SUBSCRIBERS), data=st.data())
    def ack(self, who, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.held)), min_size=1, max_size=3))
        acked, unknown = ledger.ack_deliveries(self.subscribers[who], ids, now=self.now)
        for i in set(ids):
            owner = Delivery.objects.get(pk=i).subscriber.name
            if owner == who:
                assert i not in unknown
                self._settle(i)
            else:
                assert i in unknown, "a subscriber acked another's delivery"
                assert Delivery.objects.get(pk=i).status != Status.ACKED or i not in self.held

    @precondition(lambda self: self.held)
    @rule(who=st.sampled_from(SUBSCRIBERS), data=st.data())
    def ack_then_next_heads(self, who, data):
        """An ack of ordered heads, then their lines' next heads with no read first, as a
        webhook job and a socket do (ledger.lease_heads_after): paused lines give nothing."""
        ids = data.draw(st.lists(st.sampled_from(sorted(self.held)), min_size=1, max_size=3))
        mine = set(Delivery.objects.filter(id__in=ids, subscriber__name=who).values_list("id", flat=True))
        acked, _ = ledger.ack_deliveries(self.subscribers[who], ids, now=self.now)
        for i in mine:
            self._settle(i)
        leased = ledger.lease_heads_after(self.subscribers[who], sorted(mine), limit=5, now=self.now)
        self._check_leased(who, leased, 5)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), retry_in=st.sampled_from([None, 0, 5]))
    def nack(self, data, retry_in):
        delivery_id = data.draw(st.sampled_from(sorted(self.held)))
        who, _ = self.held[delivery_id]
        row = Delivery.objects.get(pk=delivery_id)
        if row.status != Status.INFLIGHT:
            return
        updated = ledger.nack_delivery(self.subscribers[who], delivery_id, retry_in=retry_in, now=self.now)
        del self.held[delivery_id]
        if updated.status == Status.DEAD:
            assert row.attempt >= MAX_ATTEMPTS
            self._settle(delivery_id, dead=True)

    @precondition(lambda self: self.held)
    @rule(who=st.sampled_from(SUBSCRIBERS), seconds=st.sampled_from([1, 5, 30, 120]), data=st.data())
    def extend(self, who, seconds, data):
        ids = data.draw(st.lists(st.sampled_from([*sorted(self.held), 10**9]), min_size=1, max_size=3))
        rows = dict(Delivery.objects.filter(id__in=ids).values_list("id", "subscriber__name"))
        inflight = set(
            Delivery.objects.filter(id__in=ids, status=Status.INFLIGHT).values_list("id", flat=True)
        )
        extended = ledger.extend_deliveries(self.subscribers[who], ids, seconds, now=self.now)
        mine = [i for i in dict.fromkeys(ids) if rows.get(i) == who and i in inflight]
        assert extended.ids == mine, "extended what is not the caller's in flight, or missed its own"
        assert extended.unknown == [i for i in dict.fromkeys(ids) if i not in mine]
        for i in mine:  # its lease now ends then, whether it had passed its deadline or not
            self.held[i] = (who, self.now + timedelta(seconds=seconds))

    @rule(seconds=st.sampled_from([1, 3, 11, 60]))
    def time_passes(self, seconds):
        self.now += timedelta(seconds=seconds)

    @rule()
    def sweep(self):
        """The sweeper: overdue leases back (or dead), expired messages' deliveries dead."""
        ledger.expire_overdue_leases(now=self.now)
        dead = Delivery.objects.filter(id__in=list(self.held), status=Status.DEAD).values_list(
            "id", flat=True
        )
        for delivery_id in dead:
            self._settle(delivery_id, dead=True)

    @rule(who=st.sampled_from(SUBSCRIBERS))
    def drain(self, who):
        """Long enough later, everything owed can be received: nothing is stuck."""
        self.now += timedelta(seconds=ACK_TIMEOUT + 400)  # past any lease, backoff, delay and TTL
        self.held = {d: h for d, h in self.held.items() if h[0] != who}
        ledger.expire_overdue_leases(now=self.now)  # the sweep: the expired are dead, not owed
        # Paused, nothing comes (_check_leased); resumed, all that was owed does.
        first = ledger.lease_deliveries(self.subscribers[who], limit=100, now=self.now)
        self._check_leased(who, first, 100)
        ledger.ack_deliveries(self.subscribers[who], [d["id"] for d in first], now=self.now)
        for d in first:
            self._settle(d["id"])
        mine = [s for s in self.paused if self.subscription_of[s][0] == who]
        assert sorted(subscribing.resume(Subscription.objects.filter(pk__in=mine))) == sorted(mine)
        self.paused -= set(mine)
        for _ in range(100):
            leased = ledger.lease_deliveries(self.subscribers[who], limit=100, now=self.now)
            if not leased:
                break
            ledger.ack_deliveries(self.subscribers[who], [d["id"] for d in leased], now=self.now)
            for d in leased:
                self._settle(d["id"])
        for sub_id, (name, _, _) in self.subscription_of.items():
            if name == who:
                dead = set(
                    Delivery.objects.filter(subscription_id=sub_id, status=Status.DEAD).values_list(
                        "message_id", flat=True
                    )
                )
                assert self.owed[sub_id] <= dead, f"stuck: {self.owed[sub_id] - dead}"
                self.owed[sub_id].clear()

    def _settle(self, delivery_id, dead=False):
        row = Delivery.objects.get(pk=delivery_id)
        self.held.pop(delivery_id, None)
        if row.subscription_id in self.owed:
            self.owed[row.subscription_id].discard(row.message_id)
        if dead:
            self.dead.add(delivery_id)

    @rule()
    def fold_tallies(self):
        tallies.fold()

    # --- invariants ---

    def teardown(self):
        # After each run of steps (folded or not, by the fold_tallies rule): what operators
        # read is what the rows say.
        assert tallies.counts(tallies.KEY) == recount()
        # ... and so do the dashboard's figures (the same snapshot /metrics serves).
        data = snapshot.overview()
        for row in data["queues"]:
            rows = Delivery.objects.filter(queue__name=row["queue"], event__name=row["event"])
            for status in Status:
                assert row[status.value] == rows.filter(status=status).count(), (row, status)
            assert (
                row["published"]
                == Message.objects.filter(queue__name=row["queue"], event__name=row["event"]).count()
            )
        for shown in data["subscribers"]:
            rows = Delivery.objects.filter(subscriber__name=shown["subscriber"])
            for status in (Status.PENDING, Status.INFLIGHT, Status.DEAD):
                assert shown[status.value] == rows.filter(status=status).count(), (shown, status)

    @invariant()
    def nothing_is_lost(self):
        for sub_id, owed in self.owed.items():
            open_rows = set(
                Delivery.objects.filter(subscription_id=sub_id)
                .exclude(status=Status.ACKED)
                .values_list("message_id", "status")
            )
            open_messages = {m for m, s in open_rows if s != Status.DEAD}
            dead_messages = {m for m, s in open_rows if s == Status.DEAD}
            # Whatever the model says is owed is still there, open or (after expiries) dead.
            assert owed <= open_messages | dead_messages, f"subscription {sub_id} lost {owed - open_messages}"
            for m in dead_messages:
                owed.discard(m)

    @invariant()
    def ordered_groups_hold_at_most_one(self):
        inflight = Delivery.objects.filter(
            queue__ordered=True, status=Status.INFLIGHT, ack_deadline__gt=self.now
        )
        lines = list(inflight.values_list("subscription_id", "message__group"))
        assert len(lines) == len(set(lines))


@pytest.mark.django_db
def test_the_ledger_keeps_its_promises():
    run_state_machine_as_test(
        LedgerMachine,
        settings=settings(
            max_examples=150,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
