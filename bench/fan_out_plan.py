"""EXPLAIN (ANALYZE, BUFFERS) of the fan-out publish statement, and its wall time with the commit.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/mq_fan_plan \
        .venv/bin/python bench/fan_out_plan.py [--rounds 30] [--messages 100] [--subscribers 10]

Makes the database's schema (migrate), a queue with `--subscribers` subscribers of it, then:
- `--rounds` times, in a transaction rolled back with every constraint checked at once (Django's
  foreign keys are deferred to the commit, where EXPLAIN would not see them), the plan of one
  publish of `--messages` messages (publishing._publish_statement, the async path's statement):
  its execution time and each constraint trigger's time;
- `--rounds` times the same statement run and committed for real (autocommit), wall time.
Prints the medians as one JSON line.
"""

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mqsite.settings")

from django.conf import settings  # noqa: E402

settings.DATABASES["default"].get("OPTIONS", {}).pop("pool", None)

import django  # noqa: E402

django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connection, transaction  # noqa: E402
from django.utils import timezone  # noqa: E402

from delivery import publishing, subscribing  # noqa: E402
from queues.models import Queue  # noqa: E402
from subscribers.provisioning import create_subscriber  # noqa: E402


def statement(queue, count):
    outgoing = [publishing.prepare("fan", {"i": i, "pad": "x" * 100}) for i in range(count)]
    events = publishing._events(queue, {"fan"})
    gen = publishing._publish_statement(queue, outgoing, None, timezone.now(), events)
    return next(gen)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--messages", type=int, default=100)
    parser.add_argument("--subscribers", type=int, default=10)
    args = parser.parse_args()
    call_command("migrate", verbosity=0)
    queue, made = Queue.objects.get_or_create(name="fan")
    if made:
        for i in range(args.subscribers):
            subscriber, _ = create_subscriber(f"fan-{i}", subscribe=["fan"], publish=["fan"])
            subscribing.subscribe(subscriber, queue)
    executions, triggers, walls = [], [], []
    for _ in range(args.rounds):
        sql, params = statement(queue, args.messages)
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
            cursor.execute("EXPLAIN (ANALYZE, BUFFERS) " + sql, params)
            plan = "\n".join(row[0] for row in cursor.fetchall())
            transaction.set_rollback(True)
        executions.append(float(re.search(r"Execution Time: ([\d.]+)", plan).group(1)))
        found = re.findall(r"Trigger for constraint (\S+) on \S+: time=([\d.]+) calls=(\d+)", plan)
        triggers.append({name: float(ms) for name, ms, _ in found})
    for _ in range(args.rounds):
        sql, params = statement(queue, args.messages)
        with connection.cursor() as cursor:
            start = time.perf_counter()
            cursor.execute(sql, params)
            cursor.fetchall()
            walls.append((time.perf_counter() - start) * 1000)
    names = sorted({n for t in triggers for n in t})
    print(plan, file=sys.stderr)
    print(
        json.dumps(
            {
                "messages": args.messages,
                "subscribers": args.subscribers,
                "execution_ms": round(statistics.median(executions), 2),
                "triggers_ms": {n: round(statistics.median(t.get(n, 0) for t in triggers), 2) for n in names},
                "committed_wall_ms": round(statistics.median(walls), 2),
            }
        )
    )


if __name__ == "__main__":
    main()
