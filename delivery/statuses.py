"""A delivery's statuses: a module of their own so that the read model (delivery.querysets),
which delivery.models installs on the model, can name them without an import circle."""

from django.db import models


class Status(models.TextChoices):
    PENDING = "pending", "pending"
    INFLIGHT = "inflight", "in flight"
    ACKED = "acked", "acked"
    DEAD = "dead", "dead"
