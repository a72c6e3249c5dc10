import time

import mqclient.django

from .models import Shipment


@mqclient.django.handler("db", "create")
def ship(delivery):
    if delivery.payload.get("fail"):
        raise RuntimeError("cannot ship that")
    time.sleep(delivery.payload.get("sleep", 0))  # a slow handler, whose post times out
    Shipment.objects.create(order_pk=delivery.payload["pk"], delivery_id=delivery.id)
