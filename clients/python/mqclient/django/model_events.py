"""MQ["MODEL_EVENTS"]: each named model's saves and deletes as outbox rows, written by Django's
post_save and post_delete signals in the saving transaction (so a rolled-back save publishes
nothing)."""

from __future__ import annotations

from typing import Any

from django.apps import apps
from django.core import serializers
from django.core.exceptions import ImproperlyConfigured
from django.db.models.signals import post_delete, post_save
from django.utils.module_loading import import_string

from . import conf
from .outbox import publish

EVENTS = ("create", "update", "delete")


def connect() -> None:
    for label, spec in (conf.get("MODEL_EVENTS") or {}).items():
        model = apps.get_model(label)
        if not isinstance(spec, dict) or not spec.get("queue"):
            raise ImproperlyConfigured(f'MQ["MODEL_EVENTS"]["{label}"] needs a "queue"')
        events = spec.get("events", EVENTS)
        unknown = set(events) - set(EVENTS)
        if unknown:
            raise ImproperlyConfigured(f'MQ["MODEL_EVENTS"]["{label}"]: unknown events {sorted(unknown)}')
        serialize = import_string(spec["serializer"]) if spec.get("serializer") else payload_of
        if "create" in events or "update" in events:
            post_save.connect(
                _on_save(spec["queue"], events, serialize),
                sender=model,
                weak=False,
                dispatch_uid=f"mqclient-save-{label}",
            )
        if "delete" in events:
            post_delete.connect(
                _on_delete(spec["queue"], serialize),
                sender=model,
                weak=False,
                dispatch_uid=f"mqclient-delete-{label}",
            )


def payload_of(instance: Any) -> dict:
    """{"model": "shop.order", "pk": 7, "fields": {...}}, as Django's python serializer writes it."""
    return serializers.serialize("python", [instance])[0]


def _on_save(queue: str, events: list, serialize):
    def on_save(sender, instance, created, raw=False, using=None, **kwargs):
        if raw:  # loaddata: fixtures are not events
            return
        event = "create" if created else "update"
        if event in events:
            publish(queue, event, serialize(instance), using=using)

    return on_save


def _on_delete(queue: str, serialize):
    def on_delete(sender, instance, using=None, origin=None, **kwargs):
        publish(queue, "delete", serialize(instance), using=using)

    return on_delete
