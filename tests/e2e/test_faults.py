"""Fault injection, the short form (the long one is `make faults`): real Daphne processes,
Celery workers and a private Redis, with publishers and websocket, webhook and pull
subscribers on an ordered and an unordered queue, while a nemesis kills and restarts them and
drops connections. Nothing confirmed may be lost, nothing unexpected may arrive, an ordered
queue's messages must arrive first in seq order; duplicates are counted.

The checker itself is specified first, on a history made by hand.
"""

import pytest
from django.db import connection

from tests.faults.checker import check
from tests.faults.history import Delivered, Published, Subscription
from tests.faults.run import Config, run, summary


def delivered(sub, delivery_id, message_id, seq, tag, queue="q", event="create"):
    return Delivered(sub, delivery_id, message_id, queue, event, seq, tag, 1, "ws", 0.0)


class TestTheChecker:
    subs = {
        "a/q": Subscription("a/q", "a", "q", None, ordered=True),
        "b/q": Subscription("b/q", "b", "q", "create", ordered=False),
    }
    published = [Published(f"t{i}", "q", "create", 100 + i, i) for i in range(1, 6)] + [
        Published("d6", "q", "delete", 106, 6)
    ]

    def check(self, deliveries, attempted=None):
        report = check(self.subs, attempted or {}, self.published, deliveries)
        return {s.name: s for s in report.subscriptions}, report

    def test_a_clean_history_is_ok(self):
        ok = [delivered("a/q", 10 + i, 100 + i, i, f"t{i}") for i in range(1, 6)]
        ok.append(delivered("a/q", 16, 106, 6, "d6", event="delete"))
        ok += [delivered("b/q", 20 + i, 100 + i, i, f"t{i}") for i in range(1, 6)]
        subs, report = self.check(ok)
        assert report.ok
        assert subs["a/q"].expected == 6 and subs["b/q"].expected == 5  # b: create only

    def test_it_counts_a_lost_a_duplicate_and_an_out_of_order_delivery(self):
        history = [
            delivered("a/q", 11, 101, 1, "t1"),
            delivered("a/q", 13, 103, 3, "t3"),
            delivered("a/q", 12, 102, 2, "t2"),  # first delivery of seq 2 after seq 3: out of order
            delivered("a/q", 13, 103, 3, "t3"),  # again, same ids: a duplicate, not out of order
            delivered("a/q", 15, 105, 5, "t5"),  # t4 and d6 never come: lost
            delivered("a/q", 16, 106, 6, "d6", event="delete"),
        ]
        subs, report = self.check(history)
        a = subs["a/q"]
        assert (a.lost, a.duplicated, a.out_of_order, a.unexpected, a.inconsistent) == (1, 1, 1, 0, 0)
        assert not report.ok
        assert subs["b/q"].lost == 5

    def test_a_redelivery_after_a_crash_is_a_duplicate_not_out_of_order(self):
        history = [delivered("a/q", 10 + i, 100 + i, i, f"t{i}") for i in (1, 2, 3)]
        history += [delivered("a/q", 12, 102, 2, "t2"), delivered("a/q", 13, 103, 3, "t3")]
        history += [delivered("a/q", 10 + i, 100 + i, i, f"t{i}") for i in (4, 5)]
        history.append(delivered("a/q", 16, 106, 6, "d6", event="delete"))
        subs, _ = self.check(history)
        assert (subs["a/q"].duplicated, subs["a/q"].out_of_order, subs["a/q"].lost) == (2, 0, 0)

    def test_a_duplicate_with_another_delivery_id_is_inconsistent(self):
        subs, report = self.check([delivered("b/q", 21, 101, 1, "t1"), delivered("b/q", 99, 101, 1, "t1")])
        assert subs["b/q"].inconsistent == 1 and not report.ok

    def test_it_counts_what_was_never_published_or_is_not_what_was_published(self):
        history = [
            delivered("b/q", 30, 300, 9, "nobody-sent-this"),
            delivered("b/q", 31, 999, 1, "t1"),  # t1 was message 101
            delivered("b/q", 32, 106, 6, "d6", event="delete"),  # b takes only create
        ]
        subs, report = self.check(history)
        assert subs["b/q"].unexpected == 3 and not report.ok

    def test_a_delivery_of_a_publish_never_confirmed_is_allowed_apart(self):
        subs, _ = self.check([delivered("b/q", 40, 107, 7, "t7")], attempted={"t7": "q"})
        assert subs["b/q"].unconfirmed == 1 and subs["b/q"].unexpected == 0


@pytest.mark.django_db(transaction=True)
def test_it_loses_nothing_while_processes_are_killed_and_restarted(tmp_path):
    """PostgreSQL pass: the services mode (two Daphne processes, two workers, a private Redis
    restarted with and without its data). SQLite pass: the embedded mode (one Daphne, one
    worker, jobs in a folder), whose faults are the process kills and dropped connections."""
    services = connection.vendor == "postgresql"
    config = Config(
        messages=3000 if services else 1500,
        minutes=1.25,
        services=services,
        nemesis_interval_secs=(2, 4),
        history_path=str(tmp_path / "history.jsonl"),
    )
    if not services:
        config.extra_env = {"MQ_CELERY_DIR": str(tmp_path / "celery")}
    result = run(config)
    print(summary(result))
    assert result["ok"], summary(result) + "\n" + "\n".join(result["notes"][-40:])
    assert result["messages"] == config.messages
    assert result["deliveries"] >= 3 * config.messages
    every = {"kill_worker", "term_worker", "kill_web", "term_web", "drop_connections"}
    if services:
        every |= {"restart_redis", "wipe_redis"}
    assert set(result["faults"]) == every
