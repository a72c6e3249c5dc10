"""Django signals of the operational events (delivery.operational), named as the events are on
the queue mq.system. Each is sent in the process that made the change, after its commit (never
for a change rolled back), with `payloads`: the events' payloads as mq.system carries them.

    webhook_disabled      sender=Subscriber, payloads=[{"subscriber", ...}]
    webhook_enabled       sender=Subscriber, payloads=[{"subscriber", ...}]
    delivery_dead         sender=Delivery, payloads=[{"queue", "event", "subscriber", ...}, ...]
    subscription_lagging  sender=Subscription, payloads=[{"queue", "event", "subscriber", ...}, ...]
"""

from django.dispatch import Signal

webhook_disabled = Signal()
webhook_enabled = Signal()
delivery_dead = Signal()
subscription_lagging = Signal()
