from django.apps import AppConfig


class DeliveryConfig(AppConfig):
    name = "delivery"

    def ready(self):
        # Here, not in subscribers: the signals announce to delivery's sockets, and imports
        # point down (mqsite <- queues <- subscribers <- delivery). The waiters (wakeups) and
        # receipts register their words on the bus as they are imported.
        from mqsite import bus, health

        from . import lines, liveness, operational, publishing, receipts, revocation, wakeups  # noqa: F401
        from .health import process_checks

        # The operational events go out by the normal publish (operational may not import it).
        operational.publish_with(publishing.prepare, publishing.publish)

        revocation.connect_signals()
        lines.connect_signals()
        # A commit's wake-ups also enqueue the webhook jobs of subscribers without a socket.
        bus.on(bus.WAKE, _enqueue_webhooks, blocking=True)
        # A dead process's webhook jobs hold their subscribers' claims no longer.
        liveness.on_dead(_drop_webhook_claims)
        # /healthz reports the web and worker processes and the sweep.
        health.register(process_checks)


def _enqueue_webhooks(subscriber_ids, _source):
    from . import tasks

    tasks.enqueue_webhooks(subscriber_ids, kept=True)


def _drop_webhook_claims(holder_prefix, subscriber_ids):
    from . import tasks

    tasks.drop_claims_of(holder_prefix, subscriber_ids)
