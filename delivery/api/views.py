import math
import time

from django.http import Http404
from drf_spectacular.utils import extend_schema
from rest_framework import exceptions
from rest_framework.response import Response
from rest_framework.views import APIView

from delivery import ledger, liveness, wakeups
from mqsite.api import Conflict, errors, is_db_id
from queues.api.views import queue_or_404
from queues.models import Event
from queues.names import BadName, clean_name
from subscribers.api.views import SUBSCRIBERS_ONLY
from subscribers.auth import IsSubscriber, subscriber_of

from .serializers import (
    AckResultSerializer,
    AckSerializer,
    DeliveryListSerializer,
    LeaseQuerySerializer,
    NackResultSerializer,
    NackSerializer,
)

# While long-polling, look at the ledger at least this often even without a wake-up: a wake-up
# from another process, or one that was lost, costs at most this much latency.
LONG_POLL_RECHECK_SECS = 0.5


def finite_or_400(value, name):
    if value is not None and not math.isfinite(value):
        raise exceptions.ValidationError({name: ["must be a finite number"]})
    return value


class DeliveryListView(APIView):
    permission_classes = [IsSubscriber]

    @extend_schema(
        summary="Pull: lease the caller's ready deliveries, oldest seq first",
        parameters=[LeaseQuerySerializer],
        responses={
            200: DeliveryListSerializer,
            **errors(400, 401, 403, 404, 429, e403=SUBSCRIBERS_ONLY, e404="No such queue."),
        },
    )
    def get(self, request):
        # A plain dict: as form input, "?wait=" would silently mean the default; here it is a 400.
        query = LeaseQuerySerializer(data=request.query_params.dict())
        query.is_valid(raise_exception=True)
        subscriber = subscriber_of(request)
        params = query.validated_data
        wait = finite_or_400(params["wait"], "wait")
        queue = queue_or_404(params["queue"]) if params.get("queue") else None
        event_ids = None
        if params.get("event"):
            try:
                name = clean_name(params["event"], "event")
            except BadName as exc:
                raise exceptions.ValidationError({"event": [str(exc)]}) from None
            events = Event.objects.filter(name=name)
            event_ids = list((events.filter(queue=queue) if queue else events).values_list("pk", flat=True))
        deadline = time.monotonic() + wait
        while True:
            seen = wakeups.generation(subscriber.pk)
            # Held in this process's name: if it dies before the client acks (a pull answered
            # into a dead connection), another process hands these back in seconds.
            leased = ledger.lease_deliveries(
                subscriber,
                limit=params["limit"],
                queue=queue,
                event_ids=event_ids,
                holder=liveness.holder("pull"),
            )
            left = deadline - time.monotonic()
            if leased or left <= 0 or wakeups.stopping():
                return Response({"deliveries": leased})
            wakeups.wait(subscriber.pk, seen, min(left, LONG_POLL_RECHECK_SECS))


class AckView(APIView):
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
        acked, unknown = ledger.ack_deliveries(subscriber_of(request), [i for i in ids if is_db_id(i)])
        unknown += [i for i in ids if not is_db_id(i)]
        return Response({"acked": acked, "unknown": unknown})


class NackView(APIView):
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
        retry_in = finite_or_400(body.validated_data.get("retry_in"), "retry_in")
        if not is_db_id(pk):
            raise Http404("You have no delivery with that id.")
        nacked = ledger.nack_deliveries(
            subscriber_of(request),
            [pk],
            retry_in=retry_in,
            error=ledger.nack_reason(body.validated_data.get("error")),
        )
        if nacked.unknown:
            raise Http404("You have no delivery with that id.")
        if nacked.settled:
            raise Conflict(f"The delivery is already {nacked.settled[pk]}; a nack cannot move it.")
        status, attempt, next_attempt_at = nacked.done[pk]
        return Response({"id": pk, "status": status, "attempt": attempt, "next_attempt_at": next_attempt_at})
