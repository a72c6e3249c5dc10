from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import exceptions, status
from rest_framework.response import Response

from delivery import presence, subscribing
from mqsite.api import BodyRequiredSchema, errors
from subscribers import filters, replay
from subscribers.api.base import CallerView
from subscribers.api.serializers import (
    ConnectionListSerializer,
    SeekResultSerializer,
    SubscribedSerializer,
    SubscribeSerializer,
    SubscriptionChangeSerializer,
    SubscriptionListSerializer,
    SubscriptionSerializer,
    subscription_answer,
)
from subscribers.auth import IsSubscriber, operator_with
from subscribers.models import Subscription

SUBSCRIBERS_ONLY = "This call acts as a subscriber: an operator's session is refused."


class SubscriptionListView(CallerView):
    permission_classes = [IsSubscriber]

    @extend_schema(
        summary="The caller's own subscriptions",
        responses={200: SubscriptionListSerializer, **errors(401, 403, 429, e403=SUBSCRIBERS_ONLY)},
    )
    def get(self, request):
        subs = self.subscriber.subscriptions.select_related("queue", "event").order_by("id")
        return Response({"subscriptions": [subscription_answer(s) for s in subs]})

    @extend_schema(
        summary="Subscribe to a queue, to one event of it or to all",
        request=SubscribeSerializer,
        responses={
            201: SubscribedSerializer,
            200: OpenApiResponse(SubscribedSerializer, 'It existed already ("from" replays nothing then).'),
            **errors(
                400,
                401,
                403,
                404,
                409,
                429,
                e403="The subscriber may not subscribe to this queue (or the caller is no subscriber).",
                e400="A malformed body, a bad name, or a malformed filter (code bad_filter, naming the key).",
                e404="No such queue.",
                e409="A new subscription past MQ_MAX_SUBSCRIPTIONS_PER_SUBSCRIBER (delete one first).",
                e429="Throttled (MQ_THROTTLE_RATE), or a new event name past "
                "MQ_MAX_NEW_EVENTS_PER_SUBSCRIBER this hour; Retry-After says when to try again.",
            ),
        },
    )
    def post(self, request):
        serializer = SubscribeSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        subscriber = self.subscriber
        queue = self.queue_or_404(serializer.validated_data["queue"])
        if not subscriber.may_subscribe(queue):
            raise exceptions.PermissionDenied(f"{subscriber.name} may not subscribe to {queue.name}.")
        event = serializer.validated_data.get("event")
        if event is not None:
            event = self.name_or_400(event, "event")
        point = serializer.validated_data.get("from")
        filter_ = serializer.validated_data.get("filter", subscribing.KEEP)
        if point is None:
            subscription, created = subscribing.subscribe(
                subscriber, queue, event, limited=True, filter=filter_
            )
            answer = subscription_answer(subscription)
        else:
            subscription, created, replayed = subscribing.subscribe_from(
                subscriber, queue, event, point, limited=True, filter=filter_
            )
            answer = {**subscription_answer(subscription), "replay": replay.answer_of(replayed)}
        return Response(answer, status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)


class SubscriptionDetailView(CallerView):
    permission_classes = [IsSubscriber]

    def get_permissions(self):
        # A change (its filter) is its subscriber's or an operator's, as a pause is; an
        # unsubscribe stays the subscriber's own.
        if self.request.method == "PATCH":
            return [operator_with("subscribers.change_subscription", subscribers_too=True)()]
        return super().get_permissions()

    @extend_schema(
        summary="Change a subscription's filter",
        description="Publishes after the change are owed by the new filter; what the subscription was "
        "owed before stays owed. Its subscriber, or an operator with subscribers.change_subscription.",
        request=SubscriptionChangeSerializer,
        responses={
            200: SubscriptionSerializer,
            **errors(
                400,
                401,
                403,
                404,
                429,
                e400="A malformed body or filter (code bad_filter, naming the key).",
                e403="Neither a subscriber nor an operator (staff) with subscribers.change_subscription.",
                e404="No such subscription (a subscriber: none of its own with that id).",
            ),
        },
    )
    def patch(self, request, pk):
        pk = self.id_or_404(pk, "subscription")
        mine = Subscription.objects.all() if self.subscriber is None else self.subscriber.subscriptions.all()
        subscription = mine.select_related("queue", "event").filter(pk=pk).first()
        if subscription is None:
            raise exceptions.NotFound("You have no subscription with that id.")
        serializer = SubscriptionChangeSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        if "filter" in serializer.validated_data:  # a PATCH changes what it names: {} changes nothing
            subscribing.set_filter(subscription, filters.check_filter(serializer.validated_data["filter"]))
        return Response(subscription_answer(subscription))

    @extend_schema(
        summary="Unsubscribe; what the subscription was still owed is dropped",
        responses={
            204: None,
            **errors(
                401, 403, 404, 429, e403=SUBSCRIBERS_ONLY, e404="The caller has no subscription with that id."
            ),
        },
    )
    def delete(self, request, pk):
        subscription = self.subscriber.subscriptions.filter(pk=self.id_or_404(pk, "subscription")).first()
        if subscription is None:
            raise exceptions.NotFound("You have no subscription with that id.")
        subscribing.unsubscribe(subscription)
        return Response(status=status.HTTP_204_NO_CONTENT)


class SubscriptionSeekView(CallerView):
    permission_classes = [IsSubscriber]
    schema = BodyRequiredSchema()

    @extend_schema(
        summary="Replay: the subscription owes again every message from a seq or a time",
        description="Every message of the subscription's queue (and event) from that point that is "
        "still in the hot tables is owed again, in seq order: those it lacks are added, acked and "
        "dead ones handed out again as new attempts with the same delivery ids; in-flight and "
        "pending ones are left as they are. The answer's replay.from_seq is where it could start.",
        request={"application/json": replay.SEEK_SCHEMA},
        responses={
            200: SeekResultSerializer,
            **errors(
                400,
                401,
                403,
                404,
                429,
                e403="The subscriber may no longer subscribe to this queue (or the caller is no subscriber).",
                e404="The caller has no subscription with that id.",
            ),
        },
    )
    def post(self, request, pk):
        subscription = (
            self.subscriber.subscriptions.select_related("queue", "event")
            .filter(pk=self.id_or_404(pk, "subscription"))
            .first()
        )
        if subscription is None:
            raise exceptions.NotFound("You have no subscription with that id.")
        try:
            point = replay.point_of(request.data, names=False)
        except replay.BadPoint as exc:
            raise exceptions.ValidationError({exc.field: [exc.detail]}) from None
        if not self.subscriber.may_subscribe(subscription.queue):
            raise exceptions.PermissionDenied(
                f"{self.subscriber.name} may no longer subscribe to {subscription.queue.name}."
            )
        replayed = subscribing.seek(subscription, point, limited=True)
        return Response({**subscription_answer(subscription), "replay": replay.answer_of(replayed)})


_PAUSE_ERRORS = errors(
    401,
    403,
    404,
    429,
    e403="Neither a subscriber nor an operator (staff) with subscribers.change_subscription.",
    e404="No such subscription (a subscriber: none of its own with that id).",
)


class _PauseOrResume(CallerView):
    """POST /api/subscriptions/{id}/pause and /resume: its subscriber, or an operator who may
    change subscriptions (what the admin's actions ask). A subscriber never sees another's:
    someone else's id is a 404, as one that does not exist. Both are idempotent, and answer
    the subscription as it is now."""

    permission_classes = [operator_with("subscribers.change_subscription", subscribers_too=True)]

    def _set(self, pk, change):
        pk = self.id_or_404(pk, "subscription")
        mine = Subscription.objects.all() if self.subscriber is None else self.subscriber.subscriptions.all()
        subscriptions = mine.filter(pk=pk)
        change(subscriptions)
        subscription = subscriptions.select_related("queue", "event").first()
        if subscription is None:
            raise exceptions.NotFound("You have no subscription with that id.")
        return Response(subscription_answer(subscription))


class SubscriptionPauseView(_PauseOrResume):
    @extend_schema(
        summary="Pause a subscription: still owed everything published, handed nothing until resumed",
        description="Nothing of the subscription is handed out, by any transport (pull, long poll, "
        "websocket, webhook), until it is resumed; what is in flight finishes as usual (acks, nacks "
        "and extensions still work). Publishes still make its deliveries. Pausing a paused one "
        "changes nothing and answers the same. Its subscriber, or an operator.",
        request=None,
        responses={200: SubscriptionSerializer, **_PAUSE_ERRORS},
    )
    def post(self, request, pk):
        return self._set(pk, subscribing.pause)


class SubscriptionResumeView(_PauseOrResume):
    @extend_schema(
        summary="Resume a paused subscription: what it is owed is handed out again",
        description="Its subscriber's sockets, long polls and webhook are woken at once; an ordered "
        "subscription goes on from its head, in order. Resuming one that is not paused changes "
        "nothing and answers the same. Its subscriber, or an operator.",
        request=None,
        responses={200: SubscriptionSerializer, **_PAUSE_ERRORS},
    )
    def post(self, request, pk):
        return self._set(pk, subscribing.resume)


class ConnectionListView(CallerView):
    permission_classes = [operator_with("subscribers.view_connection")]

    @extend_schema(
        summary="Operators: who is connected now, and to what",
        responses={
            200: ConnectionListSerializer,
            **errors(401, 403, 429, e403="Operators (staff) with subscribers.view_connection only."),
        },
    )
    def get(self, request):
        return Response({"connections": presence.connections_now()})
