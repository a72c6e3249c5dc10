"""Queues, events and messages in the admin.

Queues are made and tuned here (or by `createqueue`); events appear on first publish or
subscribe; messages are published, never written in a form, so their pages are read-only and
show where each one still is: which subscriptions have not acknowledged it.
"""

from django import forms
from django.contrib import admin
from django.contrib.admin.utils import display_for_value
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import transaction
from django.db.models import Q
from django.http import Http404
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html, format_html_join

from mqsite import bus
from mqsite.names import BadName, clean_name
from queues import schemas
from queues.headers import NAME_RE, stored_pair
from queues.models import Event, Message, Queue
from subscribers.models import Subscription

from .. import ledger, publishing, routing, tallies
from ..big_lists import BigListAdmin
from ..models import Delivery, Status
from ..querysets import UNSETTLED
from ..reports import correlated_count, not_acked, status_count, status_counts
from .widgets import (
    DeliveriesGoWithTheirOwner,
    DeliveryCountColumns,
    EventFilter,
    LedgerOperatorMixin,
    QueueEventColumns,
    SubscriptionInlineBase,
    UnsubscribeOnDelete,
    admin_link,
    count_badge,
    deliveries_url,
    owed_links,
    paused_badge,
    pretty_json,
    search_by_id_or_name,
    status_badge,
    with_delivery_counts,
)


def headers_matching(term):
    """Messages whose headers' text contains the term; NAME=VALUE finds that header with that
    value exactly."""
    found = Q(headers_json__icontains=term)
    name, sep, value = term.partition("=")
    if sep and NAME_RE.match(name):
        found |= Q(headers_json__contains=stored_pair(name, value))
    return found


class NameCleaningForm(forms.ModelForm):
    """Queue and event names are lower-cased on input, as the API does, then checked."""

    def clean_name(self):
        try:
            return clean_name(self.cleaned_data["name"], self._meta.model._meta.verbose_name)
        except BadName as exc:
            raise ValidationError(str(exc)) from None


# What an operator sets on a queue; its page shows these, then what the server keeps (below).
QUEUE_SETTINGS = [
    "name",
    "ordered",
    "paused",
    "max_attempts",
    "ack_timeout",
    "retention_days",
    "ttl_secs",
    "lag_alert_secs",
]
QUEUE_KEPT = ["last_seq", "created_at", "owed", "who_would_receive"]


class QueueForm(NameCleaningForm):
    class Meta:
        model = Queue
        fields = QUEUE_SETTINGS


class EventForm(NameCleaningForm):
    class Meta:
        model = Event
        fields = ["queue", "name", "schema"]
        widgets = {"schema": forms.Textarea(attrs={"rows": 16, "cols": 80, "spellcheck": "false"})}

    def clean_schema(self):
        """Never stored invalid: a publish would have nothing to check against."""
        schema = self.cleaned_data.get("schema")
        if schema is not None:
            try:
                schemas.check_schema(schema)
            except schemas.BadSchema as exc:
                raise ValidationError(str(exc)) from None
        return schema


class EventInline(admin.TabularInline):
    model = Event
    fields = ["name", "created_at"]
    readonly_fields = fields
    extra = 0
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False


class QueueSubscriptionInline(SubscriptionInlineBase):
    fields = ["subscriber", "event", "state", "created_at"]
    autocomplete_fields = ["subscriber"]
    verbose_name_plural = "subscriptions (event empty: every event of the queue)"

    def get_formset(self, request, obj=None, **kwargs):
        formset = super().get_formset(request, obj, **kwargs)
        # Only this queue's events (the form class is made afresh for each request).
        event = formset.form.base_fields.get("event")
        if event is not None:
            # Each row's select lists them, each named queue/event: load the queue with them.
            events = Event.objects.filter(queue=obj).select_related("queue").order_by("name")
            event.queryset = events if obj else Event.objects.none()
        return formset


class RouteForm(forms.Form):
    """A candidate message for "who would receive this": checked as a publish checks it."""

    event = forms.CharField(max_length=64)
    payload = forms.JSONField(required=False, help_text="JSON; empty: null.")
    headers = forms.JSONField(required=False, help_text='JSON, e.g. {"tenant": "acme"}; empty: none.')

    def __init__(self, queue, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.queue = queue
        for name in ("payload", "headers"):
            self.fields[name].widget = forms.Textarea(attrs={"rows": 5, "cols": 80, "spellcheck": "false"})

    def clean(self):
        cleaned = super().clean()
        if self.errors:
            return cleaned
        try:
            outgoing = publishing.prepare(
                cleaned["event"], cleaned.get("payload"), headers=cleaned.get("headers")
            )
            publishing.check_schemas(self.queue, [outgoing])
        except publishing.SchemaMismatch as exc:
            raise ValidationError([f"{e['path'] or '/'}: {e['message']}" for e in exc.errors]) from None
        except publishing.BadMessage as exc:
            raise ValidationError(str(exc)) from None
        cleaned["outgoing"] = outgoing
        return cleaned


@admin.register(Queue)
class QueueAdmin(DeliveriesGoWithTheirOwner, UnsubscribeOnDelete, DeliveryCountColumns, admin.ModelAdmin):
    form = QueueForm
    list_display = [
        "name",
        "state",
        "ordered",
        "max_attempts",
        "ack_timeout",
        "retention_days",
        "lag_alert_secs",
        "last_seq",
        "message_count",
        "subscription_count",
        "pending",
        "inflight",
        "dead",
    ]
    list_filter = ["paused", "ordered"]
    search_fields = ["name"]
    inlines = [EventInline, QueueSubscriptionInline]
    actions = ["pause", "resume"]
    fields = [*QUEUE_SETTINGS, *QUEUE_KEPT]

    def get_readonly_fields(self, request, obj=None):
        # Clients address a queue by its name: renaming one would silently re-target them.
        return QUEUE_KEPT if obj is None else ["name", *QUEUE_KEPT]

    def get_fields(self, request, obj=None):
        return QUEUE_SETTINGS if obj is None else self.fields

    def get_urls(self):
        route = self.admin_site.admin_view(self.route_view)
        return [path("<path:object_id>/route/", route, name="queues_queue_route"), *super().get_urls()]

    @admin.display(description="who would receive")
    def who_would_receive(self, obj):
        url = reverse("admin:queues_queue_route", args=[obj.pk])
        return format_html('<a href="{}">Which subscriptions would a message be owed to, and why</a>', url)

    def route_view(self, request, object_id):
        """Who would receive this: a candidate message in, the queue's subscriptions out, each
        with whether a publish would owe it the message and why (delivery.routing, the
        fan-out's own rule). Publishes nothing. Staff who may view the queue."""
        queue = self.get_object(request, object_id)
        if queue is None:
            raise Http404("No such queue.")
        if not self.has_view_permission(request, queue):
            raise PermissionDenied
        form = RouteForm(queue, request.POST if request.method == "POST" else None)
        routed = routing.route(queue, form.cleaned_data["outgoing"]) if form.is_valid() else None
        context = {
            **self.admin_site.each_context(request),
            "title": f"Who would receive a message of {queue.name}",
            "opts": self.model._meta,
            "original": queue,
            "form": form,
            "routed": routed,
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, "admin/queues/queue/route.html", context)

    def get_queryset(self, request):
        queryset = (
            super()
            .get_queryset(request)
            .annotate(
                n_messages=status_count("queue", tallies.PUBLISHED),  # the kept counts: no scan
                n_subscriptions=correlated_count(Subscription.objects.all(), "queue"),
            )
        )
        return with_delivery_counts(queryset, "queue")

    @admin.display(description="state", ordering="paused")
    def state(self, obj):
        return paused_badge(obj.paused)

    @admin.display(description="messages", ordering="n_messages")
    def message_count(self, obj):
        return obj.n_messages

    @admin.display(description="subscriptions", ordering="n_subscriptions")
    def subscription_count(self, obj):
        return obj.n_subscriptions

    @admin.display(description="deliveries owed")
    def owed(self, obj):
        return owed_links(obj, queue__id__exact=obj.pk)

    @admin.action(description="Pause: keep taking publishes, hand out nothing", permissions=["change"])
    def pause(self, request, queryset):
        ids = list(queryset.values_list("pk", flat=True))
        paused = Queue.objects.filter(pk__in=ids, paused=False).update(paused=True)
        self.message_user(request, f"{paused} queues paused.")

    @admin.action(description="Resume: hand out deliveries again", permissions=["change"])
    def resume(self, request, queryset):
        ids = list(queryset.values_list("pk", flat=True))
        with transaction.atomic():
            resumed = Queue.objects.filter(pk__in=ids, paused=True).update(paused=False)
            # Waiting subscribers would see the work on their next timer tick; wake them now.
            bus.send_after_commit(
                bus.WAKE,
                Subscription.objects.filter(queue_id__in=ids)
                .order_by()
                .values_list("subscriber_id", flat=True)
                .distinct(),
            )
        self.message_user(request, f"{resumed} queues resumed.")


@admin.register(Event)
class EventAdmin(DeliveriesGoWithTheirOwner, DeliveryCountColumns, admin.ModelAdmin):
    form = EventForm
    list_display = [
        "name",
        "queue",
        "has_schema",
        "message_count",
        "subscription_count",
        "pending",
        "inflight",
        "dead",
    ]
    list_filter = ["queue"]
    list_select_related = ["queue"]
    search_fields = ["name", "queue__name"]
    fields = ["queue", "name", "schema", "schema_version", "schema_updated_at", "created_at"]

    def get_readonly_fields(self, request, obj=None):
        # Messages and subscriptions name the event: it keeps its name and queue.
        kept = ["schema_version", "schema_updated_at", "created_at"]
        return kept if obj is None else ["queue", "name", *kept]

    def save_model(self, request, obj, form, change):
        # A schema changed counts as a new version (queues.schemas); the history records the
        # change as for any field ("Changed payload schema.").
        if "schema" in form.changed_data:
            schemas.save_schema(obj, form.cleaned_data["schema"])
        else:
            super().save_model(request, obj, form, change)

    @admin.display(description="schema", boolean=True)
    def has_schema(self, obj):
        return obj.schema is not None

    def get_queryset(self, request):
        queryset = (
            super()
            .get_queryset(request)
            .annotate(
                n_messages=status_count("event", tallies.PUBLISHED),
                n_subscriptions=correlated_count(Subscription.objects.all(), "event"),
            )
        )
        return with_delivery_counts(queryset, "event")

    def has_delete_permission(self, request, obj=None):
        # Deleting an event deletes its messages and their deliveries.
        return request.user.is_superuser and super().has_delete_permission(request, obj)

    @admin.display(description="messages", ordering="n_messages")
    def message_count(self, obj):
        return obj.n_messages

    @admin.display(description="subscriptions", ordering="n_subscriptions")
    def subscription_count(self, obj):
        return obj.n_subscriptions


@admin.register(Message)
class MessageAdmin(DeliveriesGoWithTheirOwner, QueueEventColumns, LedgerOperatorMixin, BigListAdmin):
    list_display = [
        "id",
        "queue_name",
        "event_name",
        "seq",
        "key",
        "publisher",
        "created_at",
        "delivery_count",
        "unacked_count",
    ]
    list_filter = ["queue", EventFilter, "publisher"]
    list_select_related = ["queue", "event", "publisher"]
    # The headers are searched as their stored JSON text, contains, case-insensitive: a scan of
    # the messages that have headers (no index serves it), for an operator's occasional search.
    search_fields = ["=id", "=key", "headers_json"]
    search_help_text = (
        "A number finds a message id; anything else an idempotency key, or messages whose "
        "header names or values contain it (NAME=VALUE: that header with that value)."
    )
    raw_id_fields = ["publisher", "queue", "event"]
    ordering = ["-id"]
    # The columns an index serves (the primary key, created_at). A queue's seq is indexed
    # with its queue, but across queues a sort by seq, a name or a count sorts every message.
    sortable_by = ["id", "created_at"]
    actions = ["redeliver_unacked", "deliver_now"]
    fields = [
        "id",
        "queue",
        "event_name",
        "seq",
        "key",
        "publisher",
        "created_at",
        "deliver_at",
        "expires_at",
        "headers",
        "payload",
        "delivery_summary",
        "not_acked_by",
    ]
    readonly_fields = fields

    def get_queryset(self, request):
        return (
            super()
            .get_queryset(request)
            # Payloads may be large: the list does not show them; the page loads its own.
            .defer("payload_json", "headers_json")
            .annotate(
                n_deliveries=correlated_count(Delivery.objects.all(), "message"),
                n_unacked=correlated_count(Delivery.objects.filter(status__in=UNSETTLED), "message"),
            )
        )

    def get_search_results(self, request, queryset, search_term):
        term = search_term.strip()
        if term and not term.isdigit():
            return queryset.filter(Q(key=term) | headers_matching(term)), False
        return search_by_id_or_name(queryset, term, ["id"], []), False

    # Messages are published (API, websocket, `publish`), never made or edited in a form.
    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        # Deleting a message deletes what is owed of it, outside the ledger: superusers only.
        return request.user.is_superuser

    @admin.display(description="deliveries", ordering="n_deliveries")
    def delivery_count(self, obj):
        return obj.n_deliveries

    @admin.display(description="not acked", ordering="n_unacked")
    def unacked_count(self, obj):
        if not obj.n_unacked:
            return count_badge(0, Status.PENDING)
        url = deliveries_url(message__id__exact=obj.pk, status__in=",".join(UNSETTLED))
        return format_html('<a href="{}">{}</a>', url, count_badge(obj.n_unacked, Status.DEAD))

    @admin.display(description="payload")
    def payload(self, obj):
        return pretty_json(obj.payload_json)

    @admin.display(description="headers")
    def headers(self, obj):
        return pretty_json(obj.headers_json) if obj.headers_json else "-"

    @admin.display(description="deliveries")
    def delivery_summary(self, obj):
        counts = status_counts(obj.deliveries.all())
        return format_html_join(
            " ",
            '<a href="{}">{} {}</a>',
            (
                (
                    deliveries_url(message__id__exact=obj.pk, status__exact=s),
                    count_badge(n, s),
                    Status(s).label,
                )
                for s, n in counts.items()
            ),
        )

    @admin.display(description="not acknowledged by")
    def not_acked_by(self, obj):
        rows, total = not_acked(obj)
        if not rows:
            return "Every subscription has acknowledged it."
        body = format_html_join(
            "",
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            (
                (
                    admin_link(d, d.pk),
                    admin_link(d.subscriber, d.subscriber.name),
                    admin_link(d.subscription) if d.subscription_id else "(deleted)",
                    status_badge(d.status),
                    d.attempt,
                    display_for_value(
                        d.next_attempt_at if d.status == Status.PENDING else d.ack_deadline, "-"
                    ),
                    d.last_error or "-",
                )
                for d in rows
            ),
        )
        more = ""
        if total > len(rows):
            url = deliveries_url(message__id__exact=obj.pk, status__in=",".join(UNSETTLED))
            more = format_html('<p><a href="{}">All {} of them in the delivery list</a></p>', url, total)
        return format_html(
            '<table class="mq-not-acked"><thead><tr><th>delivery</th><th>subscriber</th>'
            "<th>subscription</th><th>status</th><th>attempt</th><th>next attempt / deadline</th>"
            "<th>last error</th></tr></thead><tbody>{}</tbody></table>{}",
            body,
            more,
        )

    @admin.action(
        description="Redeliver to every subscription that has not acknowledged it",
        permissions=["operate"],
    )
    def redeliver_unacked(self, request, queryset):
        ids = list(queryset.values_list("pk", flat=True))
        moved = ledger.redeliver(Delivery.objects.filter(message_id__in=ids))
        self.message_user(request, f"{moved} deliveries put back to pending.")

    @admin.action(
        description="Deliver now: a delayed message's deliveries stop waiting for its deliver_at",
        permissions=["operate"],
    )
    def deliver_now(self, request, queryset):
        ids = list(queryset.values_list("pk", flat=True))
        moved = ledger.deliver_now(Delivery.objects.filter(message_id__in=ids))
        # Written in each message's history: who cut its delay short.
        for message in Message.objects.filter(pk__in=ids, deliver_at__isnull=False).select_related(
            "queue", "event"
        ):
            self.log_change(request, message, "delivered now, before its deliver_at")
        self.message_user(request, f"{moved} deliveries of delayed messages ready now.")
