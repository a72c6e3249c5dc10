"""The admin's pages, all here since each shows or moves deliveries: the queues, events and
messages (queues.py), the subscribers, subscriptions and connections (subscribers.py), the
deliveries and dead letters (deliveries.py), and what they share (widgets.py). Django's admin
autodiscovery imports this module; importing the pages registers them."""

from . import deliveries, queues, subscribers  # noqa: F401
