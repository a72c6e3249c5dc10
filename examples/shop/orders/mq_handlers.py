"""Handlers of what the server delivers to the shop. mqclient.django imports each installed
app's mq_handlers module at start-up; the webhook view (and `manage.py mqlisten`) runs them in one
transaction with the delivery's id, so a post the server repeats runs nothing twice."""

import mqclient.django

from .models import Order, Shipment


@mqclient.django.handler("db", "create")
def ship(delivery):
    # The payload is the order as Django's serializer wrote it when it was saved:
    # {"model": "orders.order", "pk": 7, "fields": {"item": "tea", "quantity": 2, ...}}
    if delivery.payload.get("model") != "orders.order":
        return
    order = Order.objects.filter(pk=delivery.payload["pk"]).first()
    if order is None:  # deleted meanwhile: nothing to ship
        return
    Shipment.objects.get_or_create(order=order, defaults={"delivery_id": delivery.id})
