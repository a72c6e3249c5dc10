from django.apps import AppConfig


class DeliveryConfig(AppConfig):
    name = "delivery"

    def ready(self):
        # Here, not in subscribers: the signals announce to delivery's sockets, and imports
        # point down (mqsite <- queues <- subscribers <- delivery).
        from . import revocation, tasks, wakeups

        revocation.connect_signals()
        # A commit's wake-ups also enqueue the webhook jobs of subscribers without a socket.
        wakeups.on_wake(tasks.enqueue_webhooks)
