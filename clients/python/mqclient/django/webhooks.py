"""The receiving side: webhook_view checks the Standard Webhooks signature the server signs
each post with (docs/webhooks.md), then runs the registered handlers in one transaction that
also records the delivery id, so a redelivery (the answer to the first post was lost) runs
nothing again."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from django.db import IntegrityError, router, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from ..delivery import Delivery
from . import conf

log = logging.getLogger("mqclient.django.webhooks")

Handler = Callable[[Delivery], Any]
_handlers: list[tuple[str, str | None, Handler]] = []


def handler(queue: str, event: str | None = None) -> Callable[[Handler], Handler]:
    """Register `fn(delivery)` for the deliveries of `queue` (of `event`; None: every event)."""

    def register(fn: Handler) -> Handler:
        _handlers.append((queue, event, fn))
        return fn

    return register


def handlers_for(queue: str, event: str) -> list[Handler]:
    return [fn for q, e, fn in _handlers if q == queue and e in (None, event)]


def subscriptions() -> list[tuple[str, str | None]]:
    """(queue, event) of the registered handlers, each once, for listen()."""
    return list(dict.fromkeys((q, e) for q, e, _ in _handlers))


class _Nacked(Exception):
    """A handler nacked its delivery (listen): its transaction is rolled back."""


class _NackedByHandler(Exception):
    pass


class _WebhookSettler:
    """The answer to the post is the ack: ack() does nothing more; nack() rolls back and
    answers 500, so the server retries."""

    def settle_ack(self, delivery: Delivery) -> None:
        return None

    def settle_nack(self, delivery: Delivery, retry_in: float | None, error: str | None) -> None:
        raise _NackedByHandler(error or "nacked by the handler")


def _problem(status: int, code: str, detail: str) -> JsonResponse:
    return JsonResponse({"detail": detail, "code": code}, status=status)


@csrf_exempt
@require_POST
def webhook_view(request: HttpRequest) -> HttpResponse:
    secret = conf.get("WEBHOOK_SECRET")
    if not secret:  # the system check mqclient.E001 says so at start-up; 500: the server retries
        log.error('webhook post refused: settings.MQ["WEBHOOK_SECRET"] is not set')
        return _problem(500, "not_configured", "This receiver has no webhook secret set.")
    try:
        body = request.body.decode()
        Webhook(secret).verify(body, {k: v for k, v in request.headers.items()}, json_parse=False)
    except (WebhookVerificationError, UnicodeDecodeError, ValueError) as exc:
        # ValueError: a malformed signature list (no "v1," before a value, bad base64)
        log.warning("webhook post refused: %s", exc)
        return _problem(401, "bad_signature", "The webhook signature or timestamp is not valid.")
    try:
        frame = json.loads(body)
        delivery = delivery_of(frame, request.headers.get("webhook-id"))
    except (ValueError, TypeError, KeyError) as exc:
        return _problem(400, "bad_body", f"The body is not a message frame: {exc}")
    try:
        ran = handle(delivery)
    except Exception as exc:  # the handler's: rolled back, the server retries the post
        log.exception(
            "webhook handler failed on delivery %s (%s/%s)", delivery.id, delivery.queue, delivery.event
        )
        return _problem(500, "handler_failed", f"{type(exc).__name__}: {exc}"[:1000])
    return JsonResponse({"handled": ran})


def delivery_of(frame: Any, webhook_id: str | None = None) -> Delivery:
    """The Delivery of a webhook body (the websocket's message frame)."""
    if not isinstance(frame, dict):
        raise ValueError("not a JSON object")
    for field in ("queue", "event"):
        if not isinstance(frame.get(field), str):
            raise ValueError(f"no {field}")
    frame = {**frame, "id": int(frame.get("id", webhook_id))}
    if webhook_id is not None and str(frame["id"]) != webhook_id:
        raise ValueError("the body's id is not the webhook-id")
    return Delivery(frame, _WebhookSettler())


def handle(delivery: Delivery) -> bool:
    """Run the delivery's handlers in one transaction with its record: True when they ran now,
    False when it was handled before (nothing runs) or a handler nacked it (rolled back). A
    handler's exception rolls all of it back and goes up."""
    from .models import ReceivedDelivery

    using = router.db_for_write(ReceivedDelivery)
    try:
        with transaction.atomic(using=using):
            # The record first: a second post of the same delivery arriving meanwhile waits
            # on its primary key, then finds it (IntegrityError) rather than running twice.
            ReceivedDelivery.objects.using(using).create(
                id=delivery.id, queue=delivery.queue, event=delivery.event
            )
            for fn in handlers_for(delivery.queue, delivery.event):
                fn(delivery)
                if delivery.settled == "nacked":  # over the socket: it comes again, so undo
                    raise _Nacked
    except _Nacked:
        return False
    except IntegrityError:
        if ReceivedDelivery.objects.using(using).filter(id=delivery.id).exists():
            return False
        raise
    return True
