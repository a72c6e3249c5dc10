from django.db import models


class Order(models.Model):
    item = models.CharField(max_length=100)
    quantity = models.IntegerField(default=1)

    def __str__(self):
        return self.item


class Shipment(models.Model):
    """Written by the webhook handler: one per delivery it ran for."""

    order_pk = models.IntegerField()
    delivery_id = models.BigIntegerField()

    def __str__(self):
        return f"order {self.order_pk}"
