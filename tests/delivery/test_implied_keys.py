"""A delivery's queue and event are relations without a constraint in the database (their
checks are implied by its message's keys, which are kept: delivery/models.py); its subscriber's
key is kept. Deleting any of the three still deletes its deliveries, and deleting one while a
publish fans out to it leaves no delivery naming what is gone. Real threads against
the real database (run on SQLite and on PostgreSQL by `make test`)."""

import threading

import pytest
from django.db import connection, transaction

from delivery import ledger, publishing, subscribing
from delivery.models import Delivery, Status
from queues.models import Event, Message, Queue
from subscribers.models import Subscriber, Subscription
from subscribers.provisioning import create_subscriber

pytestmark = pytest.mark.django_db(transaction=True)


def orphans():
    """Deliveries naming a subscriber, queue or event that is gone."""
    return {
        "subscriber": Delivery.objects.exclude(subscriber_id__in=Subscriber.objects.values("id")).count(),
        "queue": Delivery.objects.exclude(queue_id__in=Queue.objects.values("id")).count(),
        "event": Delivery.objects.exclude(event_id__in=Event.objects.values("id")).count(),
    }


NONE = {"subscriber": 0, "queue": 0, "event": 0}


def setup(subscribers=2):
    queue = Queue.objects.create(name="orders")
    subs = []
    for i in range(subscribers):
        subscriber, _ = create_subscriber(f"s{i}", publish=["*"], subscribe=["*"])
        subscribing.subscribe(subscriber, queue)
        subs.append(subscriber)
    return queue, subs


def publish(queue, count=5, event="created"):
    return publishing.publish(queue, [publishing.prepare(event, i) for i in range(count)])


def test_deleting_a_subscriber_deletes_its_deliveries_even_those_an_unsubscribe_left():
    queue, (gone, kept) = setup()
    publish(queue)
    # Acked history outlives an unsubscribe (its subscription becomes NULL): only the
    # subscriber's own key names it now, and it has no constraint any more.
    leased = ledger.lease_deliveries(gone, limit=2)
    ledger.ack_deliveries(gone, [d["id"] for d in leased])
    subscribing.unsubscribe(Subscription.objects.get(subscriber=gone))
    assert Delivery.objects.filter(subscriber=gone, subscription=None, status=Status.ACKED).count() == 2
    gone.delete()
    assert not Delivery.objects.filter(subscriber_id=gone.pk).exists()
    assert Delivery.objects.filter(subscriber=kept).count() == 5
    assert orphans() == NONE


def test_deleting_an_event_or_a_queue_deletes_their_deliveries():
    queue, _ = setup()
    publish(queue, event="created")
    publish(queue, event="updated")
    Event.objects.get(queue=queue, name="created").delete()
    assert Delivery.objects.count() == 10
    assert orphans() == NONE
    queue.delete()
    assert not Delivery.objects.exists() and not Message.objects.exists()


def _race(publisher, deleter):
    """Run `publisher` in a transaction held open until `deleter`, in another thread, has
    started; returns (the publisher's error, the deleter's error), either None."""
    errors = {}
    started = threading.Event()

    def publish_side():
        try:
            with transaction.atomic():
                publisher()
                started.set()
                # Long enough for the delete to be under way (on SQLite it waits for this
                # commit: one writer), short enough for a test.
                threading.Event().wait(0.5)
        except Exception as exc:
            errors["publish"] = exc
        finally:
            started.set()
            connection.close()

    def delete_side():
        started.wait(10)
        try:
            deleter()
        except Exception as exc:
            errors["delete"] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=publish_side), threading.Thread(target=delete_side)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return errors.get("publish"), errors.get("delete")


@pytest.mark.parametrize("parent", ["subscriber", "queue", "event"])
def test_a_parent_deleted_while_a_publish_fans_out_to_it_leaves_no_orphan(parent):
    queue, (subscriber, _) = setup()
    publish(queue, count=1)  # the event exists, and is remembered
    event = Event.objects.get(queue=queue, name="created")
    target = {"subscriber": subscriber, "queue": queue, "event": event}[parent]
    published, deleted = _race(
        lambda: publish(queue, count=20), lambda: type(target).objects.get(pk=target.pk).delete()
    )
    # One of the two may fail (PostgreSQL checks the kept keys at each one's commit: the
    # subscription's or the message's), never both succeed leaving rows behind.
    assert orphans() == NONE, (published, deleted)
    assert published is None or deleted is None, (published, deleted)
    if deleted is None:
        assert not type(target).objects.filter(pk=target.pk).exists()
    else:
        owed = 21 if parent == "subscriber" else 42  # 21 messages, to one subscriber or to both
        assert Delivery.objects.filter(**{f"{parent}_id": target.pk}).count() == owed
