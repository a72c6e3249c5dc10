"""Deliveries in the admin: browse and filter them, with each one's webhook attempt history;
redeliver, kill or purge them; and the dead letters on a list of their own.

Every field is read-only: a delivery's state moves only through delivery.ledger, which the
actions call. There may be millions of rows, so the list avoids a query per row, joins
only what it shows, and does not count a whole unfiltered table exactly.
"""

from django.contrib import admin
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.db.models import Count
from django.template.response import TemplateResponse
from django.utils.html import format_html
from django.utils.text import Truncator

from .. import ledger
from ..big_lists import BigListAdmin
from ..models import DeadLetter, Delivery, DeliveryAttempt, Status
from ..reports import dead_letters
from .widgets import (
    EventFilter,
    LedgerOperatorMixin,
    QueueEventColumns,
    admin_link,
    may_view_deliveries,
    pretty_json,
    search_by_id_or_name,
    status_badge,
)


class DeliveryAttemptInline(admin.TabularInline):
    """A delivery's webhook attempts, oldest first: what operators read on a dead letter."""

    model = DeliveryAttempt
    fields = ["number", "at", "ok", "failure", "status_code", "error", "duration_ms"]
    readonly_fields = fields
    # Numbers start again at 1 after an operator's redelivery; the time keeps the order.
    ordering = ["at", "id"]
    extra = 0
    can_delete = False
    verbose_name_plural = "webhook attempts (one row per post to the subscriber's webhook)"

    @admin.display(description="failure")
    def failure(self, obj):
        """Whether a failure looks permanent (fix the endpoint or the URL) or transient; both
        are retried on the backoff schedule."""
        if obj.ok:
            return "-"
        return "permanent" if obj.permanent else "transient"

    # Attempts are written by the webhook job, never in a form; whoever may see the delivery
    # may see its history.
    def has_view_permission(self, request, obj=None):
        return may_view_deliveries(request)

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(Delivery)
class DeliveryAdmin(QueueEventColumns, LedgerOperatorMixin, BigListAdmin):
    list_display = [
        "id",
        "subscriber_name",
        "queue_name",
        "event_name",
        "seq",
        "status_badge",
        "attempt",
        "next_attempt_at",
        "ack_deadline",
        "acked_at",
        "short_error",
    ]
    list_display_links = ["id"]
    list_filter = ["status", "queue", "subscriber", EventFilter]
    list_select_related = ["subscriber", "queue", "event"]
    search_fields = ["=message__id", "subscriber__name"]
    search_help_text = "A number finds a message id or a delivery id; words find subscriber names."
    # No form edits a delivery; were one to, no select would list 200,000 messages.
    raw_id_fields = ["subscription", "subscriber", "message", "queue", "event"]
    ordering = ["-id"]
    # Sorted only by id (the primary key): no other column of every delivery has an index, and
    # indexing one would cost each lease and ack another entry (Delivery.Meta).
    sortable_by = ["id"]
    actions = ["redeliver", "deliver_now", "kill", "purge"]
    inlines = [DeliveryAttemptInline]
    fields = [
        "id",
        "status_badge",
        "subscriber_link",
        "subscription_link",
        "message_link",
        "queue_name",
        "event_name",
        "seq",
        "attempt",
        "next_attempt_at",
        "deliver_at",
        "expires_at",
        "ack_deadline",
        "lease_holder",
        "created_at",
        "delivered_at",
        "acked_at",
        "last_error",
        "headers",
        "payload",
    ]
    readonly_fields = fields

    def get_search_results(self, request, queryset, search_term):
        found = search_by_id_or_name(queryset, search_term, ["message_id", "id"], ["subscriber__name"])
        return found, False

    # Deliveries come from publishing and change only through the ledger (the actions).
    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    @admin.display(description="subscriber", ordering="subscriber__name")
    def subscriber_name(self, obj):
        return obj.subscriber.name

    @admin.display(description="status", ordering="status")
    def status_badge(self, obj):
        return status_badge(obj.status)

    @admin.display(description="last error")
    def short_error(self, obj):
        if not obj.last_error:
            return ""
        return format_html('<span title="{}">{}</span>', obj.last_error, Truncator(obj.last_error).chars(60))

    @admin.display(description="subscriber")
    def subscriber_link(self, obj):
        return admin_link(obj.subscriber)

    @admin.display(description="subscription")
    def subscription_link(self, obj):
        if obj.subscription_id is None:
            return "(deleted)"
        return admin_link(obj.subscription)

    @admin.display(description="message")
    def message_link(self, obj):
        return admin_link(obj.message, f"#{obj.message_id} ({obj.queue.name}#{obj.seq})")

    @admin.display(description="payload")
    def payload(self, obj):
        return pretty_json(obj.message.payload_json)

    @admin.display(description="headers")
    def headers(self, obj):
        return pretty_json(obj.message.headers_json) if obj.message.headers_json else "-"

    @admin.action(
        description="Redeliver: back to pending, ready now (acked ones are left alone)",
        permissions=["operate"],
    )
    def redeliver(self, request, queryset):
        moved = ledger.redeliver(queryset.order_by())
        self.message_user(request, f"{moved} deliveries put back to pending.")

    @admin.display(description="deliver at")
    def deliver_at(self, obj):
        return obj.message.deliver_at or "-"

    @admin.action(
        description="Deliver now: those waiting for their message's deliver_at are ready now",
        permissions=["operate"],
    )
    def deliver_now(self, request, queryset):
        ids = list(queryset.order_by().values_list("pk", flat=True))
        waiting = list(
            Delivery.objects.filter(
                pk__in=ids, status=Status.PENDING, attempt=0, message__deliver_at__isnull=False
            ).select_related("queue", "event", "subscriber")
        )
        moved = ledger.deliver_now(Delivery.objects.filter(pk__in=ids))
        for delivery in waiting:  # in each one's history: who cut its delay short
            self.log_change(request, delivery, "delivered now, before its deliver_at")
        self.message_user(request, f"{moved} delayed deliveries ready now.")

    @admin.action(description="Kill: mark dead (acked ones are left alone)", permissions=["operate"])
    def kill(self, request, queryset):
        killed = ledger.kill_deliveries(queryset.order_by())
        self.message_user(request, f"{killed} deliveries marked dead.")

    def has_purge_permission(self, request):
        # Purging deletes rows for good: it takes the right to delete deliveries, though no
        # one deletes a delivery through its delete page.
        return request.user.has_perm("delivery.delete_delivery")

    @admin.action(
        description="Purge: delete the dead ones with their attempt history (others are left alone)",
        permissions=["purge"],
    )
    def purge(self, request, queryset):
        if request.POST.get("post") != "yes":
            return self.confirm_purge(request, queryset)
        purged = ledger.purge_dead(queryset.order_by())
        self.message_user(request, f"{purged} dead deliveries purged.")
        return None

    def confirm_purge(self, request, queryset):
        """A page that says what a purge would delete, by queue and subscriber, and asks again.
        Its form posts back to the same list (filters and "select all" included)."""
        dead = queryset.order_by().filter(status=Status.DEAD)
        groups = list(
            dead.values("queue__name", "subscriber__name")
            .annotate(n=Count("pk"))
            .order_by("queue__name", "subscriber__name")
        )
        n_dead = sum(g["n"] for g in groups)
        context = {
            **self.admin_site.each_context(request),
            "title": "Purge dead deliveries?",
            "opts": self.model._meta,
            "groups": groups,
            "n_dead": n_dead,
            "n_other": queryset.order_by().count() - n_dead,
            "selected": request.POST.getlist(ACTION_CHECKBOX_NAME),
            "select_across": request.POST.get("select_across", "0"),
            "action_checkbox_name": ACTION_CHECKBOX_NAME,
            "action": "purge",
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, "admin/delivery/purge_confirmation.html", context)


@admin.register(DeadLetter)
class DeadLetterAdmin(DeliveryAdmin):
    """Dead deliveries by queue and subscriber, with the last error, when each died and how
    many webhook tries it had; redeliver or purge them. The counts and times are annotated,
    so the list asks the same queries for a hundred rows as for one."""

    list_display = [
        "id",
        "subscriber_name",
        "queue_name",
        "event_name",
        "seq",
        "attempt",
        "tries",
        "short_error",
        "died",
    ]
    list_filter = [
        ("queue", admin.RelatedOnlyFieldListFilter),
        ("subscriber", admin.RelatedOnlyFieldListFilter),
        EventFilter,
    ]
    # Sorting by these sorts every dead letter (only id has an index to serve it): bearable
    # while dead letters are thousands, as they are when operators redeliver or purge them.
    sortable_by = ["id", "seq", "attempt", "tries", "died"]
    actions = ["redeliver", "purge"]

    def get_queryset(self, request):
        return dead_letters(super().get_queryset(request))

    # Dead letters are deliveries: whoever may see these sees those, with no grant of its own.
    def has_view_permission(self, request, obj=None):
        return may_view_deliveries(request)

    @admin.display(description="webhook tries", ordering="n_tries")
    def tries(self, obj):
        return obj.n_tries

    @admin.display(description="died (about)", ordering="died_at")
    def died(self, obj):
        # The ledger does not stamp the death: the last webhook try, else the last hand-out.
        return obj.died_at
