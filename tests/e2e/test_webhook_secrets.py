"""Rotating a webhook secret without missing a delivery: a real worker signs its posts with the
new secret and, for MQ_WEBHOOK_SECRET_GRACE_SECS after the rotation, with the old one too
(Standard Webhooks: several `v1,` signatures); a receiver that still has the old secret
verifies them meanwhile, and only the new secret verifies a post after the grace."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from standardwebhooks import Webhook, WebhookVerificationError

from delivery import subscribing
from queues.models import Queue
from subscribers.models import Subscriber
from subscribers.provisioning import create_subscriber
from tests.support import servers
from tests.support.receivers import Receiver
from tests.support.servers import ROOT, start_daphne, start_redis, start_worker

pytestmark = pytest.mark.django_db(transaction=True)

GRACE_SECS = 4


@pytest.fixture
def webhook_services(settings):
    settings.MQ_WEBHOOK_ALLOW_PRIVATE = True
    receiver = Receiver()
    redis = start_redis()
    env = {"REDIS_URL": redis.url, "MQ_WEBHOOK_ALLOW_PRIVATE": "true", "MQ_BACKOFF_BASE_SECS": "0.2"}
    queue = Queue.objects.create(name="db")
    monitor, _ = create_subscriber("monitor", subscribe=["db"], webhook_url=receiver.url)
    subscribing.subscribe(monitor, queue)
    _, token = create_subscriber("app", publish=["db"])
    web, worker = start_daphne(env), start_worker(env)
    yield {"web": web, "token": token, "receiver": receiver, "secret": monitor.webhook_secret}
    worker.stop()
    web.stop()
    redis.stop(signal.SIGKILL)
    receiver.close()


def publish_and_receive(webhook_services, n):
    """Publish one message; the post the receiver gets for it: (body, headers)."""
    body = json.dumps({"event": "create", "payload": {"n": n}}).encode()
    req = urllib.request.Request(
        f"{webhook_services['web'].http}/api/queues/db/messages",
        data=body,
        headers={"Authorization": f"Bearer {webhook_services['token']}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 201
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for _, _, headers, got in list(webhook_services["receiver"].requests):
            if json.loads(got)["payload"] == {"n": n}:
                return got, {k.lower(): v for k, v in headers.items()}
        time.sleep(0.1)
    raise AssertionError(f"no post for message {n} within 30 s")


def verifies(secret, post):
    body, headers = post
    try:
        Webhook(secret).verify(body, headers)
    except WebhookVerificationError:
        return False
    return True


def rotate_webhook_secret(name):
    """`manage.py rotatewebhooksecret` as an operator runs it, with a short grace."""
    env = {
        **os.environ,
        "DATABASE_URL": servers.test_database_url(),
        "MQ_WEBHOOK_SECRET_GRACE_SECS": str(GRACE_SECS),
    }
    env.pop("PYTEST_CURRENT_TEST", None)
    out = subprocess.run(
        [sys.executable, "manage.py", "rotatewebhooksecret", name],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return out.splitlines()[-1]


def test_a_receiver_verifies_with_the_old_secret_during_the_grace_and_only_the_new_after(webhook_services):
    old = webhook_services["secret"]
    before = publish_and_receive(webhook_services, 1)
    assert verifies(old, before)

    new = rotate_webhook_secret("monitor")
    rotated_at = time.monotonic()
    assert new != old and new.startswith("whsec_")
    assert Subscriber.objects.get(name="monitor").webhook_secret == new

    # During the grace: two signatures, either secret verifies (a receiver switching over).
    during = publish_and_receive(webhook_services, 2)
    assert time.monotonic() - rotated_at < GRACE_SECS, "too slow to test the grace"
    assert len(during[1]["webhook-signature"].split()) == 2
    assert verifies(old, during) and verifies(new, during)

    # After it: the new secret only.
    time.sleep(max(GRACE_SECS + 0.5 - (time.monotonic() - rotated_at), 0))
    after = publish_and_receive(webhook_services, 3)
    assert len(after[1]["webhook-signature"].split()) == 1
    assert verifies(new, after)
    assert not verifies(old, after)
