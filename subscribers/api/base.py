"""The base of the REST views that act for a caller: who is calling (a subscriber by its token,
or None for an operator's session) and the queue a name points at. Above mqsite.api.ApiView,
which knows neither: the caller is this app's, the queues are the layer below."""

from rest_framework import exceptions

from mqsite.api import ApiView
from queues import lookup
from subscribers.auth import subscriber_of


class CallerView(ApiView):
    @property
    def subscriber(self):
        """The calling subscriber, or None for an operator."""
        return subscriber_of(self.request)

    def queue_or_404(self, name, field="queue"):
        """The queue of that name; a name that breaks the naming rule is a 400 (the contract),
        one that could exist but does not a 404, whatever the caller's rights."""
        self.name_or_400(name, field)
        queue = lookup.find_queue(name)
        if queue is None:
            raise exceptions.NotFound(f"There is no queue named {name!r}.", code="unknown_queue")
        return queue

    def seen_queue_or_404(self, name):
        """queue_or_404(), and for a subscriber a queue it may neither publish nor subscribe to is a
        404 too, as if there were none: it learns nothing of queues it has no right to (the event
        catalog's rule, and the route's). An operator's permission is its view's."""
        queue = self.queue_or_404(name)
        subscriber = self.subscriber
        if subscriber is not None and not (subscriber.may_publish(queue) or subscriber.may_subscribe(queue)):
            raise exceptions.NotFound(f"There is no queue named {queue.name!r}.", code="unknown_queue")
        return queue
