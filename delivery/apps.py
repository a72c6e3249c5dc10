from django.apps import AppConfig


class DeliveryConfig(AppConfig):
    name = "delivery"

    def ready(self):
        # Here, not in subscribers: the signals announce to delivery's sockets, and imports
        # point down (mqsite <- queues <- subscribers <- delivery).
        from . import revocation

        revocation.connect_signals()
