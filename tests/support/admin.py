"""The admin's addresses and actions, as an operator's browser reaches them."""

from django.urls import reverse


def changelist(model):
    return reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_changelist")


def change(obj, pk=None):
    """The change page of a row: change(row), or change(Model, pk) for a row shown through
    another model of the admin (a dead letter is a delivery)."""
    model, pk = (obj, pk) if pk is not None else (obj, obj.pk)
    return reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_change", args=[pk])


def act(client, model, action, rows, query="", **extra):
    """Run an admin action on rows (or their primary keys) from the model's list page."""
    return client.post(
        changelist(model) + query,
        {"action": action, "_selected_action": [getattr(row, "pk", row) for row in rows], **extra},
        follow=True,
    )
