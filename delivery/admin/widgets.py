"""What several admin pages share (deliveries, queues, subscribers): status badges, links, the
delivery count columns, the event filter and the subscription inline. Below the pages: each page
imports from here, none from another page."""

import json

from django import forms
from django.contrib import admin
from django.core.exceptions import ValidationError
from django.db.models import F, Q
from django.forms.models import BaseInlineFormSet, InlineForeignKeyField
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode

from queues.models import Event
from subscribers import filters
from subscribers.models import Subscription

from .. import subscribing
from ..models import Delivery, Status
from ..reports import status_count

STATUS_COLOURS = {
    Status.PENDING: "#8a6d00",
    Status.INFLIGHT: "#1f5fa8",
    Status.ACKED: "#2e7d32",
    Status.DEAD: "#b3261e",
}


def status_badge(status):
    """A delivery status as a coloured label."""
    label = Status(status).label if status in Status.values else status
    return format_html(
        '<span class="mq-status mq-status-{}" style="background:{};color:#fff;padding:1px 7px;'
        'border-radius:9px;font-size:11px;white-space:nowrap">{}</span>',
        status,
        STATUS_COLOURS.get(status, "#555"),
        label,
    )


def count_badge(count, status):
    """A count of deliveries in one status, coloured only when it is not zero."""
    if not count:
        return format_html('<span style="color:{}">0</span>', "#999")
    return format_html(
        '<span style="color:{};font-weight:bold">{}</span>', STATUS_COLOURS.get(status, "#555"), count
    )


def pretty_json(text):
    """A stored payload (JSON text) indented for people, as a <pre> block."""
    try:
        shown = json.dumps(json.loads(text), indent=2, ensure_ascii=False, sort_keys=False)
    except ValueError:
        shown = text
    return format_html('<pre class="mq-payload" style="white-space:pre-wrap;margin:0">{}</pre>', shown)


def admin_link(obj, text=None):
    """A link to an object's change page in the admin."""
    if obj is None:
        return "-"
    opts = obj._meta
    url = reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[obj.pk])
    return format_html('<a href="{}">{}</a>', url, text if text is not None else str(obj))


class EventFilter(admin.SimpleListFilter):
    """Events by queue/name, in one query (the stock filter asks for each event's queue), and
    only the chosen queue's events once a queue is chosen."""

    title = "event"
    parameter_name = "event"
    queue_parameter = "queue__id__exact"

    def lookups(self, request, model_admin):
        events = Event.objects.select_related("queue").order_by("queue__name", "name")
        queue = request.GET.get(self.queue_parameter, "")
        if queue.isdigit():
            events = events.filter(queue_id=int(queue))
        return [(str(e.pk), f"{e.queue.name}/{e.name}") for e in events]

    def queryset(self, request, queryset):
        value = self.value()
        if value is None:
            return queryset
        if not value.isdigit():
            return queryset.none()
        return queryset.filter(event_id=int(value))


def search_by_id_or_name(queryset, term, id_fields, name_fields):
    """A number finds by the (indexed) id fields; anything else by the name fields."""
    term = term.strip()
    if not term:
        return queryset
    if term.isdigit():
        number = int(term)
        if number > 2**63 - 1:
            return queryset.none()
        q = Q()
        for field in id_fields:
            q |= Q(**{field: number})
        return queryset.filter(q)
    q = Q()
    for field in name_fields:
        q |= Q(**{f"{field}__icontains": term})
    return queryset.filter(q)


class DeliveriesGoWithTheirOwner:
    """Deleting a queue, event, message or subscriber deletes its deliveries with it. No one
    may delete a delivery on its own (that is the ledger's business), but that must not
    forbid deleting what owns it: the delete page would refuse for want of that permission."""

    def get_deleted_objects(self, objs, request):
        deleted, model_count, perms_needed, protected = super().get_deleted_objects(objs, request)
        perms_needed.discard(Delivery._meta.verbose_name)
        return deleted, model_count, perms_needed, protected


class LedgerOperatorMixin:
    """Delivery actions need the right to change deliveries, though no form may change one."""

    def has_operate_permission(self, request):
        return request.user.has_perm("delivery.change_delivery")


def may_view_deliveries(request):
    return request.user.has_perm("delivery.view_delivery") or request.user.has_perm(
        "delivery.change_delivery"
    )


def deliveries_url(**filters):
    """The delivery list filtered by the admin's query parameters."""
    return reverse("admin:delivery_delivery_changelist") + "?" + urlencode(filters)


def age(delta):
    """A duration in the largest two units that matter: '42 s', '5 min 3 s', '2 h 4 min'."""
    if delta is None:
        return "-"
    secs = max(int(delta.total_seconds()), 0)
    days, secs = divmod(secs, 86400)
    hours, secs = divmod(secs, 3600)
    mins, secs = divmod(secs, 60)
    parts = [(days, "d"), (hours, "h"), (mins, "min"), (secs, "s")]
    while len(parts) > 1 and parts[0][0] == 0:
        parts.pop(0)
    return " ".join(f"{n} {unit}" for n, unit in parts[:2])


def with_delivery_counts(queryset, field):
    """Annotate n_pending, n_inflight and n_dead: the outer row's deliveries (by `field`)."""
    return queryset.annotate(
        n_pending=status_count(field, Status.PENDING),
        n_inflight=status_count(field, Status.INFLIGHT),
        n_dead=status_count(field, Status.DEAD),
    )


def owed_links(obj, **filters):
    """The counts with_delivery_counts annotated on `obj`, each a link to those deliveries."""
    return format_html_join(
        " ",
        '<a href="{}">{} {}</a>',
        (
            (deliveries_url(**filters, status__exact=status), count_badge(count, status), status.label)
            for status, count in (
                (Status.PENDING, obj.n_pending),
                (Status.INFLIGHT, obj.n_inflight),
                (Status.DEAD, obj.n_dead),
            )
        ),
    )


class QueueEventColumns:
    """The queue and event of a row with both (a delivery, a message), as sortable columns."""

    @admin.display(description="queue", ordering="queue__name")
    def queue_name(self, obj):
        return obj.queue.name

    @admin.display(description="event", ordering="event__name")
    def event_name(self, obj):
        return obj.event.name


class DeliveryCountColumns:
    """List columns for the counts that with_delivery_counts annotates."""

    @admin.display(description="pending", ordering="n_pending")
    def pending(self, obj):
        return count_badge(obj.n_pending, Status.PENDING)

    @admin.display(description="in flight", ordering="n_inflight")
    def inflight(self, obj):
        return count_badge(obj.n_inflight, Status.INFLIGHT)

    @admin.display(description="dead", ordering="n_dead")
    def dead(self, obj):
        return count_badge(obj.n_dead, Status.DEAD)

    # Youngest first; nothing pending counts as the youngest of all.
    @admin.display(description="oldest pending", ordering=F("oldest_pending_at").desc(nulls_first=True))
    def oldest_pending(self, obj):
        if obj.oldest_pending_at is None:
            return "-"
        return age(timezone.now() - obj.oldest_pending_at)


class SubscriptionForm(forms.ModelForm):
    """A subscription's event must be of its queue. Once made, a subscription's queue and event
    stay: its deliveries were fanned out for them. Delete it and make another instead."""

    class Meta:
        model = Subscription
        fields = ["subscriber", "queue", "event"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.instance.pk:
            for name in ("subscriber", "queue", "event"):
                field = self.fields.get(name)
                # An inline's own foreign key (InlineForeignKeyField) is fixed already.
                if field is not None and not isinstance(field, InlineForeignKeyField):
                    field.disabled = True

    def clean(self):
        cleaned = super().clean()
        queue = cleaned.get("queue")
        if queue is None and self.instance.queue_id:
            queue = self.instance.queue
        event = cleaned.get("event")
        if queue is not None and event is not None and event.queue_id != queue.pk:
            self.add_error("event", f"{event} is not an event of the queue {queue.name}.")
        return cleaned


class SubscriptionFilterForm(SubscriptionForm):
    """The subscription's own page: its filter too, as JSON, checked as the API checks it
    (subscribers.filters); the admin's save sets it (subscribing.set_filter). Not in the inlines:
    a row there that does not show it must not clear it."""

    # Not named `filter`: the model's field is not editable, and a form field of its name
    # would be refused as one.
    filter_json = forms.JSONField(
        label="filter",
        required=False,
        widget=forms.Textarea(attrs={"rows": 6, "cols": 80, "spellcheck": "false"}),
        help_text='Only messages whose values match are owed, e.g. {"payload.kind": ["red", "blue"], '
        '"headers.tenant": ["acme", null]}: each key headers.NAME or payload.FIELD[.FIELD...] (at most 4), '
        "each with a list of allowed values; an absent key matches only null. Empty: every message.",
    )

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["filter_json"].initial = self.instance.filter

    def clean_filter_json(self):
        try:
            return filters.check_filter(self.cleaned_data.get("filter_json"))
        except filters.BadFilter as exc:
            raise ValidationError(str(exc)) from None


class SharedChoicesFormSet(BaseInlineFormSet):
    """Every row's queue and event selects list the same choices: they are read once for the
    rows, not once per row and select (a subscriber with 30 subscriptions asked 60 queries)."""

    shared_choices = ("queue", "event")

    def _construct_form(self, i, **kwargs):
        form = super()._construct_form(i, **kwargs)
        cache = self.__dict__.setdefault("_choices", {})
        for name in self.shared_choices:
            field = form.fields.get(name)
            if field is None or isinstance(field, InlineForeignKeyField):
                continue
            if name not in cache:
                cache[name] = list(field.choices)
            field.choices = cache[name]
        return form


def paused_badge(paused):
    """A queue's or a subscription's state: paused (hands out nothing) or running."""
    label, colour = ("paused", "#8a6d00") if paused else ("running", "#2e7d32")
    return format_html(
        '<span style="background:{};color:#fff;padding:1px 7px;border-radius:9px">{}</span>',
        colour,
        label,
    )


class SubscriptionInlineBase(admin.TabularInline):
    model = Subscription
    form = SubscriptionForm
    formset = SharedChoicesFormSet
    extra = 0
    show_change_link = True
    readonly_fields = ["created_at", "state"]

    @admin.display(description="state")
    def state(self, obj):
        return paused_badge(obj.paused) if obj.pk else "-"

    def formfield_for_foreignkey(self, db_field, request, **kwargs):
        if db_field.name == "event":
            # Event names print as queue/event: load the queues with them, not one by one.
            kwargs["queryset"] = Event.objects.select_related("queue").order_by("queue__name", "name")
        return super().formfield_for_foreignkey(db_field, request, **kwargs)

    def get_queryset(self, request):
        return super().get_queryset(request).select_related("subscriber", "queue", "event__queue")


class UnsubscribeOnDelete:
    """Subscriptions deleted from an inline are unsubscribed (what they were owed is dropped)."""

    def save_formset(self, request, form, formset, change):
        if formset.model is not Subscription:
            return super().save_formset(request, form, formset, change)
        instances = formset.save(commit=False)
        for subscription in formset.deleted_objects:
            subscribing.unsubscribe(subscription)
        for subscription in instances:
            subscription.save()
        formset.save_m2m()
