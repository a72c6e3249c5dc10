"""Provisioning for the comparison, inside the app's own Django (one process for a whole mode,
instead of a `manage.py createsubscriber` per subscriber).

Reads a JSON spec on stdin, prints a JSON answer on stdout. Uses the app's services
(provisioning.create_subscriber, subscribing.subscribe), except for the many idle subscribers
of W6, which are bulk-inserted with tokens issued the way the app issues them.

    {"queues": ["w2-rest", ...], "ordered": ["w7-rest", ...],
     "subscribers": [{"name": "w2-rest-0", "subscribe": ["w2-rest"], "publish": [],
                      "webhook"?: "http://..."}, ...],
     "idle": {"queue": "idle", "count": 10000}}
    ->  {"tokens": {"w2-rest-0": "mq_..."}, "secrets": {"<a webhook subscriber>": "whsec_..."},
         "idle_tokens": ["mq_...", ...]}

The queues named in "ordered" are made ordered (W7's); a subscriber with a "webhook" gets that
URL and its webhook secret is returned, to check the posts' signatures.
"""

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mqsite.settings")

import django  # noqa: E402

django.setup()

from django.db import transaction  # noqa: E402

from delivery import subscribing  # noqa: E402
from queues.models import Queue  # noqa: E402
from subscribers.models import Subscriber, Subscription  # noqa: E402
from subscribers.provisioning import provision_subscriber  # noqa: E402


def provision(spec):
    ordered = set(spec.get("ordered", []))
    for name in [*spec.get("queues", []), *sorted(ordered)]:
        Queue.objects.get_or_create(name=name, defaults={"ordered": name in ordered})
    tokens, secrets = {}, {}
    for sub in spec.get("subscribers", []):
        subscriber, tokens[sub["name"]], _, secret = provision_subscriber(
            sub["name"],
            publish=sub.get("publish", []),
            subscribe=sub.get("subscribe", []),
            webhook_url=sub.get("webhook", ""),
        )
        if secret:
            secrets[sub["name"]] = secret
        for queue_name in sub.get("subscribe", []):
            if queue_name != "*":
                subscribing.subscribe(subscriber, Queue.objects.get(name=queue_name))
    idle_tokens = []
    idle = spec.get("idle")
    if idle:
        queue, _ = Queue.objects.get_or_create(name=idle["queue"])
        prefix = idle.get("prefix", "idle")
        with transaction.atomic():
            rows = []
            for k in range(idle["count"]):
                s = Subscriber(name=f"{prefix}-{k}", subscribe_all=True)
                idle_tokens.append(s.issue_token())
                rows.append(s)
            made = Subscriber.objects.bulk_create(rows, batch_size=1000)
            Subscription.objects.bulk_create(
                [Subscription(subscriber=s, queue=queue) for s in made], batch_size=1000
            )
    return {"tokens": tokens, "secrets": secrets, "idle_tokens": idle_tokens}


if __name__ == "__main__":
    print(json.dumps(provision(json.load(sys.stdin))))
