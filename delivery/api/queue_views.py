from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, PolymorphicProxySerializer, extend_schema
from rest_framework import exceptions, status
from rest_framework.response import Response

from delivery import group_commit, observe, publishing, routing
from mqsite.api import BodyRequiredSchema, errors
from mqsite.names import NAME_HELP, SCHEMA_PATTERN
from queues.models import Queue
from subscribers.api.base import CallerView
from subscribers.auth import operator_with

from .queue_serializers import (
    EventCatalogSerializer,
    PublishBatchSerializer,
    PublishedBatchSerializer,
    PublishedSerializer,
    PublishSerializer,
    QueueListSerializer,
    RouteAnswerSerializer,
    RouteSerializer,
    SchemaMismatchSerializer,
    publish_body,
)

# One message or a batch, as it was sent.
PUBLISHED = PolymorphicProxySerializer(
    component_name="PublishResponse",
    serializers=[PublishedSerializer, PublishedBatchSerializer],
    resource_type_field_name=None,
)


QUEUE_PARAMETER = OpenApiParameter(
    "queue", str, OpenApiParameter.PATH, pattern=SCHEMA_PATTERN, description=NAME_HELP
)


class MessagesView(CallerView):
    schema = BodyRequiredSchema()
    permission_classes = [operator_with("queues.add_message", subscribers_too=True)]

    @extend_schema(
        summary="Publish one message, or a batch of up to 1000 (all or nothing)",
        parameters=[QUEUE_PARAMETER],
        request=PolymorphicProxySerializer(
            component_name="PublishRequest",
            serializers=[PublishSerializer, PublishBatchSerializer],
            resource_type_field_name=None,
        ),
        responses={
            400: OpenApiResponse(
                SchemaMismatchSerializer,
                "Malformed body, a bad name, or a payload that fails its event's schema (code "
                "schema_mismatch, with `errors`: [{index, path, message}]; nothing published).",
            ),
            201: PUBLISHED,
            200: OpenApiResponse(
                PUBLISHED, "Every idempotency key was used before: the first messages, nothing new."
            ),
            **errors(
                401,
                403,
                404,
                413,
                429,
                e403="The subscriber may not publish to this queue, or the operator lacks "
                "queues.add_message.",
                e404="No such queue.",
                e413="A payload over MQ_MAX_PAYLOAD_BYTES, a body over MQ_MAX_BODY_BYTES, one message's "
                "body longer than its payload's limit allows, or a body of over 200,000 arrays and objects.",
                e429="Throttled (MQ_THROTTLE_RATE), or new event names past "
                "MQ_MAX_NEW_EVENTS_PER_SUBSCRIBER this hour (nothing published); Retry-After says when.",
            ),
        },
    )
    def post(self, request, queue):
        queue = self.queue_or_404(queue)
        subscriber = self.subscriber
        if subscriber is not None and not subscriber.may_publish(queue):
            raise exceptions.PermissionDenied(f"{subscriber.name} may not publish to {queue.name}.")
        outgoing, batch = publish_body(request.data)
        try:
            with observe.publishing("rest"):
                answers = group_commit.publish(queue, outgoing, publisher=subscriber)
        except publishing.SchemaMismatch as exc:
            return Response(schema_mismatch_body(exc), status=status.HTTP_400_BAD_REQUEST)
        created = any(new for _, new in answers)
        code = status.HTTP_201_CREATED if created else status.HTTP_200_OK
        if batch:
            return Response({"messages": [a for a, _ in answers]}, status=code)
        return Response(answers[0][0], status=code)


def schema_mismatch_body(exc):
    """A SchemaMismatch as the 400's body: the words, the code and each failure."""
    return {"detail": str(exc), "code": exc.code, "errors": exc.errors}


class QueueListView(CallerView):
    permission_classes = [operator_with("queues.view_queue", subscribers_too=True)]

    @extend_schema(
        summary="The queues the caller may publish or subscribe to",
        responses={
            200: QueueListSerializer,
            **errors(401, 403, 429, e403="An operator without queues.view_queue."),
        },
    )
    def get(self, request):
        subscriber = self.subscriber
        queues = Queue.objects.prefetch_related("events")
        if subscriber is not None:
            queues = queues.filter(subscriber.visible_queue_filter()).distinct()
            may_publish = set(subscriber.publish_queues.values_list("pk", flat=True))
            may_subscribe = set(subscriber.subscribe_queues.values_list("pk", flat=True))
        answer = []
        for q in queues:
            answer.append(
                {
                    "name": q.name,
                    "ordered": q.ordered,
                    "events": sorted(e.name for e in q.events.all()),
                    "max_attempts": q.max_attempts,
                    "ack_timeout": q.ack_timeout,
                    "retention_days": q.retention_days,
                    "paused": q.paused,
                    "ttl_secs": q.ttl_secs,
                    "may_publish": not q.is_system
                    and (subscriber is None or subscriber.publish_all or q.pk in may_publish),
                    "may_subscribe": subscriber is None or subscriber.subscribe_all or q.pk in may_subscribe,
                }
            )
        return Response({"queues": answer})


class EventCatalogView(CallerView):
    permission_classes = [operator_with("queues.view_queue", subscribers_too=True)]

    @extend_schema(
        summary="The queue's events with their payload schemas (the event catalog)",
        parameters=[QUEUE_PARAMETER],
        responses={
            200: EventCatalogSerializer,
            **errors(
                400,
                401,
                403,
                404,
                429,
                e400="A queue name that breaks the naming rule.",
                e403="An operator without queues.view_queue.",
                e404="No such queue, or one the subscriber may neither publish nor subscribe to.",
            ),
        },
    )
    def get(self, request, queue):
        queue = self.seen_queue_or_404(queue)
        events = queue.events.order_by("name").values("name", "schema", "schema_updated_at")
        return Response({"queue": queue.name, "events": list(events)})


class RouteView(CallerView):
    permission_classes = [operator_with("queues.view_queue", subscribers_too=True)]

    @extend_schema(
        summary="Who would receive this: which subscriptions a message would be owed to, and why",
        description="Publishes nothing. Each subscription of the queue (a subscriber: only its own) "
        "with `matches` (a publish now would owe it that message; a paused subscription or queue "
        "is still owed, and held) and the reason in words: event differs, filter key K has V (or "
        "is absent), subscriber inactive, no right to subscribe, being unsubscribed, or owed (held "
        "while paused). The body is checked as a publish's (its event's schema too).",
        parameters=[QUEUE_PARAMETER],
        request=RouteSerializer,
        responses={
            200: RouteAnswerSerializer,
            400: OpenApiResponse(
                SchemaMismatchSerializer,
                "A malformed body or name, or a payload that fails its event's schema (schema_mismatch).",
            ),
            **errors(
                401,
                403,
                404,
                413,
                429,
                e403="An operator without queues.view_queue.",
                e404="No such queue, or one the subscriber may neither publish nor subscribe to.",
                e413="A payload over MQ_MAX_PAYLOAD_BYTES.",
            ),
        },
    )
    def post(self, request, queue):
        queue = self.seen_queue_or_404(queue)
        serializer = RouteSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        outgoing = serializer.validated_data
        try:
            publishing.check_schemas(queue, [outgoing])
        except publishing.SchemaMismatch as exc:
            return Response(schema_mismatch_body(exc), status=status.HTTP_400_BAD_REQUEST)
        return Response({"subscriptions": routing.route(queue, outgoing, self.subscriber)})
