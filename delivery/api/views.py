from django.db import connection
from drf_spectacular.utils import extend_schema
from rest_framework import exceptions
from rest_framework.response import Response

from delivery import ledger, liveness, long_polls, receipts, spans
from mqsite.api import errors
from mqsite.values import is_db_id
from queues.models import Event
from subscribers.api.base import CallerView
from subscribers.auth import IsSubscriber, is_operator, operator_with

from .serializers import (
    AckResultSerializer,
    AckSerializer,
    DeliveryListSerializer,
    ExtendResultSerializer,
    ExtendSerializer,
    LeaseQuerySerializer,
    NackResultSerializer,
    NackSerializer,
    ReceiptSerializer,
)
from .subscription_views import SUBSCRIBERS_ONLY


def release_connection():
    """Give the request's database connection back while a long poll waits, so that forty
    waiting polls do not hold forty of the pool's connections (issue 14) and starve every
    publish and ack; the next lease takes one again. PostgreSQL: closing returns it to psycopg's
    pool. SQLite keeps its connection: it is an open file, with no server slot or pool to run
    out of, and idle in autocommit it holds no lock, while reopening it (and its PRAGMAs) would
    cost more than the lease. Inside a transaction (a test's) there is nothing to give back."""
    if connection.vendor != "sqlite" and not connection.in_atomic_block:
        connection.close()


class DeliveryListView(CallerView):
    permission_classes = [IsSubscriber]

    @extend_schema(
        summary="Pull: lease the caller's ready deliveries, oldest seq first",
        parameters=[LeaseQuerySerializer],
        responses={
            200: DeliveryListSerializer,
            **errors(
                400,
                401,
                403,
                404,
                429,
                e403=SUBSCRIBERS_ONLY,
                e404="No such queue.",
                e429="Throttled (MQ_THROTTLE_RATE), or the subscriber already has MQ_MAX_LONG_POLLS long "
                "polls waiting (wait > 0); Retry-After says when to try again.",
            ),
        },
    )
    def get(self, request):
        # A plain dict: as form input, "?wait=" would silently mean the default; here it is a 400.
        query = LeaseQuerySerializer(data=request.query_params.dict())
        query.is_valid(raise_exception=True)
        subscriber = self.subscriber
        params = query.validated_data
        wait = params["wait"]  # finite: DRF's FloatField refuses NaN and infinity
        queue = self.queue_or_404(params["queue"]) if params.get("queue") else None
        event_ids = None
        if params.get("event"):
            name = self.name_or_400(params["event"], "event")
            events = Event.objects.filter(name=name)
            event_ids = list((events.filter(queue=queue) if queue else events).values_list("pk", flat=True))

        @spans.pulled(subscriber)
        def lease(holder):
            # Held in this process's name: if it dies before the client acks (a pull answered
            # into a dead connection), another process hands these back in seconds.
            return ledger.lease_deliveries(
                subscriber, limit=params["limit"], queue=queue, event_ids=event_ids, holder=holder
            )

        if wait <= 0:  # a plain pull is never refused by the long polls' cap
            return Response({"deliveries": lease(liveness.holder("pull"))})
        return Response(
            {"deliveries": long_polls.wait_for_deliveries(request, lease, wait, release_connection)}
        )


class AckView(CallerView):
    permission_classes = [IsSubscriber]

    @extend_schema(
        summary="Acknowledge deliveries",
        request=AckSerializer,
        responses={200: AckResultSerializer, **errors(400, 401, 403, 429, e403=SUBSCRIBERS_ONLY)},
    )
    def post(self, request):
        body = AckSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        ids = body.validated_data["ids"]
        acked, unknown = ledger.ack_deliveries(self.subscriber, [i for i in ids if is_db_id(i)])
        unknown += [i for i in ids if not is_db_id(i)]
        return Response({"acked": acked, "unknown": unknown})


class ExtendView(CallerView):
    """A worker that needs longer than its queue's ack timeout keeps its deliveries: each of the
    caller's in-flight deliveries among `ids` is leased until now + `seconds`, its attempt
    unchanged. Ids that are pending, acked, dead, expired or another subscriber's are `unknown`
    and untouched."""

    permission_classes = [IsSubscriber]

    @extend_schema(
        summary="Extend leases: move the ack deadline of the caller's in-flight deliveries to now + seconds",
        request=ExtendSerializer,
        responses={200: ExtendResultSerializer, **errors(400, 401, 403, 429, e403=SUBSCRIBERS_ONLY)},
    )
    def post(self, request):
        body = ExtendSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        extended = ledger.extend_deliveries(
            self.subscriber, body.validated_data["ids"], body.validated_data["seconds"]
        )
        return Response({"extended": len(extended.ids), "unknown": extended.unknown})


class NackView(CallerView):
    permission_classes = [IsSubscriber]

    @extend_schema(
        summary="Give a delivery back: pending again after retry_in seconds or its backoff",
        request=NackSerializer,
        responses={
            200: NackResultSerializer,
            **errors(
                400,
                401,
                403,
                404,
                409,
                429,
                e403=SUBSCRIBERS_ONLY,
                e404="Not the caller's delivery, or no such delivery.",
            ),
        },
    )
    def post(self, request, pk):
        body = NackSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        status, attempt, next_attempt_at = ledger.nack_one(  # NotOwned, AlreadySettled: ApiView answers
            self.subscriber,
            self.id_or_404(pk, "delivery"),
            retry_in=body.validated_data.get("retry_in"),
            error=ledger.nack_reason(body.validated_data.get("error")),
        )
        return Response({"id": pk, "status": status, "attempt": attempt, "next_attempt_at": next_attempt_at})


class MessageView(CallerView):
    permission_classes = [operator_with("queues.view_message", subscribers_too=True)]

    @extend_schema(
        summary="A receipt: how far the deliveries of a message the caller published got",
        description="The publisher of the message (or an operator) sees the count of its deliveries in "
        "each state; operators with delivery.view_delivery also see its subscriptions (the first "
        "1000). A message another subscriber or an operator published is a 404 to a subscriber, "
        "as one that does not exist.",
        responses={
            200: ReceiptSerializer,
            **errors(
                401,
                403,
                404,
                429,
                e403="A logged-in user who is not an operator (staff), or lacks queues.view_message.",
                e404="No such message, or the caller did not publish it.",
            ),
        },
    )
    def get(self, request, id):  # noqa: A002 (the path's name, as the contract writes it)
        answer = receipts.receipt_of(
            self.id_or_404(id, "message"),
            publisher=self.subscriber,
            operator=is_operator(request),
            subscriptions=is_operator(request, "delivery.view_delivery"),
        )
        if answer is None:
            raise exceptions.NotFound("You published no message with that id.")
        return Response(answer)
