from django.db import models


class Order(models.Model):
    """Its saves are published as db/create and db/update (settings.MQ["MODEL_EVENTS"])."""

    item = models.CharField(max_length=100)
    quantity = models.PositiveIntegerField(default=1)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self):
        return f"{self.quantity} x {self.item}"

    def as_json(self):
        return {
            "id": self.pk,
            "item": self.item,
            "quantity": self.quantity,
            "created_at": self.created_at.isoformat(),
        }


class Shipment(models.Model):
    """Written by the webhook handler, once per order whatever how often the server posts it.
    Not in MODEL_EVENTS: the handler publishes nothing, so nothing loops."""

    order = models.OneToOneField(Order, on_delete=models.CASCADE, related_name="shipment")
    delivery_id = models.BigIntegerField(help_text="the server's delivery that shipped it")
    shipped_at = models.DateTimeField(auto_now_add=True)

    def __str__(self):
        return f"shipment of order {self.order_id}"
