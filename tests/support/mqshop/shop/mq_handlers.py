import mqclient.django

from .models import Shipment


@mqclient.django.handler("db", "create")
def ship(delivery):
    if delivery.payload.get("fail"):
        raise RuntimeError("cannot ship that")
    Shipment.objects.create(order_pk=delivery.payload["pk"], delivery_id=delivery.id)
