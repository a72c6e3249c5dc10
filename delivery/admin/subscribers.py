"""Subscribers, subscriptions and who is connected now, in the admin.

A subscriber's token is issued when it is created (or rotated by the action) and shown to the
operator once, in a message; only its hash is kept. Its webhook secret is kept (each post's HMAC
needs it) but likewise shown only when made (with its first webhook URL) or rotated by the
action, to an operator who may change subscribers: never on its page, which staff who may only
view subscribers read too. A subscription removed here goes through
subscribing.unsubscribe, so what it was still owed is dropped as the API would drop it.
Connections belong to presence: they are only looked at here, or closed (by a superuser)
through presence.close_connection, so that what they held goes back to pending, and the
socket is told to close (the bus's `changed` word, delivery.revocation).
"""

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.admin.utils import display_for_value
from django.db import transaction
from django.db.models import F, OuterRef, Prefetch, Subquery
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode

from mqsite import bus, limits
from queues.models import Event
from subscribers import provisioning, replay
from subscribers.models import STALE_AFTER_SECS, Connection, Subscriber, Subscription

from .. import presence, subscribing, webhook_health
from ..models import Status, WebhookHealth
from ..reports import (
    correlated_count,
    oldest_pending_at,
    owed_to_subscriber,
    subscriber_backlog,
)
from .widgets import (
    DeliveriesGoWithTheirOwner,
    DeliveryCountColumns,
    SubscriptionFilterForm,
    SubscriptionInlineBase,
    UnsubscribeOnDelete,
    admin_link,
    age,
    count_badge,
    deliveries_url,
    owed_links,
    paused_badge,
    with_delivery_counts,
)


def heartbeat(connection):
    """When the connection was last seen, with a badge when that is too long ago."""
    seen = display_for_value(connection.last_seen, "-")
    if not connection.is_stale(timezone.now()):
        return seen
    return format_html(
        '{} <span class="mq-stale" title="no heartbeat for over {} s: the sweep will close it" '
        'style="background:#b3261e;color:#fff;padding:1px 7px;border-radius:9px;font-size:11px">'
        "stale</span>",
        seen,
        STALE_AFTER_SECS,
    )


class SubscriberSubscriptionInline(SubscriptionInlineBase):
    fields = ["queue", "event", "state", "created_at"]
    verbose_name_plural = "subscriptions (event empty: every event of the queue)"


class SubscriberConnectionInline(admin.TabularInline):
    """Its open websockets: read-only, as presence keeps them."""

    model = Connection
    fields = ["channel_name", "remote_addr", "connected_at", "last_seen_badge"]
    readonly_fields = fields
    extra = 0
    can_delete = False
    show_change_link = True
    verbose_name_plural = "connected now (open websockets; each receives every subscription above)"

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def get_queryset(self, request):
        # Each row prints as its subscriber's name: load it with the rows, not one by one.
        return super().get_queryset(request).select_related("subscriber")

    @admin.display(description="last seen")
    def last_seen_badge(self, obj):
        return heartbeat(obj)


@admin.register(Subscriber)
class SubscriberAdmin(
    DeliveriesGoWithTheirOwner, UnsubscribeOnDelete, DeliveryCountColumns, admin.ModelAdmin
):
    list_display = [
        "name",
        "is_active",
        "connected",
        "token_hint",
        "has_webhook",
        "webhook_state",
        "publish_all",
        "subscribe_all",
        "subscription_count",
        "pending",
        "oldest_pending",
        "inflight",
        "dead",
        "created_at",
    ]
    list_filter = ["is_active", "publish_all", "subscribe_all"]
    search_fields = ["name"]
    filter_horizontal = ["publish_queues", "subscribe_queues"]
    readonly_fields = ["token_hint", "webhook_secret_state", "webhook_health_state", "created_at", "owed"]
    inlines = [SubscriberSubscriptionInline]
    actions = ["issue_new_token", "rotate_webhook_secret", "enable_webhook", "disable_webhook"]

    def get_fieldsets(self, request, obj=None):
        permissions = (
            "Permissions",
            {"fields": ["publish_all", "publish_queues", "subscribe_all", "subscribe_queues"]},
        )
        if obj is None:
            # The token and the webhook secret are made on save; the token is shown then, once.
            return [
                (None, {"fields": ["name", "is_active"]}),
                ("Webhook", {"fields": ["webhook_url"]}),
                permissions,
            ]
        return [
            (None, {"fields": ["name", "is_active", "token_hint", "created_at"]}),
            ("Webhook", {"fields": ["webhook_url", "webhook_secret_state", "webhook_health_state"]}),
            permissions,
            ("What it is owed", {"fields": ["owed"]}),
        ]

    def get_inlines(self, request, obj):
        # A subscriber being added has no connection yet.
        if obj is None:
            return [SubscriberSubscriptionInline]
        return [SubscriberSubscriptionInline, SubscriberConnectionInline]

    def get_queryset(self, request):
        queryset = (
            super()
            .get_queryset(request)
            .annotate(
                n_subscriptions=correlated_count(Subscription.objects.all(), "subscriber"),
                n_connections=correlated_count(Connection.objects.all(), "subscriber"),
                oldest_pending_at=oldest_pending_at("subscriber"),
            )
        )
        # The list's webhook state, as one subquery per column (not a join: the actions lock
        # these rows, and FOR UPDATE refuses the nullable side of an outer join).
        health = WebhookHealth.objects.filter(pk=OuterRef("pk"))
        queryset = queryset.annotate(
            **{f"health_{f}": Subquery(health.values(f)[:1]) for f in WEBHOOK_STATE_FIELDS}
        )
        return with_delivery_counts(queryset, "subscriber")

    def formfield_for_dbfield(self, db_field, request, **kwargs):
        if db_field.name == "webhook_url":
            kwargs["assume_scheme"] = "https"
        return super().formfield_for_dbfield(db_field, request, **kwargs)

    def save_model(self, request, obj, form, change):
        token = None if change else obj.issue_token()
        old_url = form.initial.get("webhook_url", "") if change else ""
        secret = obj.secret_for_first_webhook(old_url, timezone.now())
        super().save_model(request, obj, form, change)
        if token is not None:
            self._show_token(request, obj, token)
        if secret is not None:
            self._show_webhook_secret(request, obj, secret)

    def _show_webhook_secret(self, request, subscriber, secret):
        messages.success(
            request,
            format_html(
                "The webhook secret of {}: <code class='mq-webhook-secret'>{}</code> Copy it now: "
                "it will not be shown again.",
                subscriber.name,
                secret,
            ),
        )

    def _show_token(self, request, subscriber, token):
        messages.success(
            request,
            format_html(
                "The token of {}: <code class='mq-token'>{}</code> Copy it now: only its hash is "
                "kept, and it will not be shown again.",
                subscriber.name,
                token,
            ),
        )

    @admin.action(description="Issue a new token (the old one stops working at once)", permissions=["change"])
    def issue_new_token(self, request, queryset):
        issued = []
        with transaction.atomic():
            for subscriber in queryset.select_for_update():
                token = subscriber.issue_token()
                subscriber.save(update_fields=["token_hash", "token_hint"])
                issued.append((subscriber, token))
        for subscriber, token in issued:
            self._show_token(request, subscriber, token)

    @admin.action(
        description="Rotate the webhook secret (the old one still signs for a grace period)",
        permissions=["change"],
    )
    def rotate_webhook_secret(self, request, queryset):
        for pk in queryset.order_by("pk").values_list("pk", flat=True):
            subscriber, secret = provisioning.rotate_webhook_secret(pk)
            if subscriber is None:
                continue  # deleted meanwhile
            self.log_change(request, subscriber, "rotated the webhook secret")
            self._show_webhook_secret(request, subscriber, secret)
            until = subscriber.previous_webhook_secret_until
            if until is not None:
                self.message_user(
                    request,
                    f"{subscriber.name}: posts are signed with the old secret too until "
                    f"{display_for_value(until, '-')}, so its receiver can switch meanwhile.",
                )

    @admin.action(
        description="Enable the webhook again (delivers everything it is owed)", permissions=["change"]
    )
    def enable_webhook(self, request, queryset):
        by = request.user.get_username()
        for subscriber in queryset.order_by("pk"):
            if webhook_health.enable(subscriber, by=by):
                self.log_change(request, subscriber, "enabled the webhook again")
                self.message_user(
                    request, f"{subscriber.name}: webhook enabled; what it is owed goes out now."
                )
            else:
                self.message_user(
                    request, f"{subscriber.name}: its webhook was not disabled.", messages.WARNING
                )

    @admin.action(
        description="Disable the webhook (posts nothing; deliveries stay owed)", permissions=["change"]
    )
    def disable_webhook(self, request, queryset):
        by = request.user.get_username()
        for subscriber in queryset.order_by("pk"):
            if not subscriber.webhook_url:
                self.message_user(request, f"{subscriber.name} has no webhook.", messages.WARNING)
            elif webhook_health.disable(subscriber, by=by):
                self.log_change(request, subscriber, "disabled the webhook")
                self.message_user(request, f"{subscriber.name}: webhook disabled; its deliveries stay owed.")

    @admin.display(description="webhook health")
    def webhook_health_state(self, obj):
        return webhook_state_html(obj, webhook_health.health_of(obj), long=True)

    @admin.display(description="webhook state")
    def webhook_state(self, obj):
        found = {f: getattr(obj, f"health_{f}", None) for f in WEBHOOK_STATE_FIELDS}
        health = WebhookHealth(subscriber_id=obj.pk, **found) if found["failures"] is not None else None
        return webhook_state_html(obj, health)

    @admin.display(description="webhook secret")
    def webhook_secret_state(self, obj):
        # Never the secret itself: this page is read by staff who may only view subscribers.
        made = display_for_value(obj.webhook_secret_set_at or obj.created_at, "-")
        words = (
            f"made {made}; shown only then. The action \u201cRotate the webhook secret\u201d makes a new one."
        )
        until = obj.previous_webhook_secret_until
        if obj.previous_webhook_secret and until is not None and until > timezone.now():
            words += f" The previous one still signs posts until {display_for_value(until, '-')}."
        return words

    @admin.display(description="webhook", boolean=True)
    def has_webhook(self, obj):
        return bool(obj.webhook_url)

    @admin.display(description="subscriptions", ordering="n_subscriptions")
    def subscription_count(self, obj):
        return obj.n_subscriptions

    @admin.display(description="connected", ordering="n_connections")
    def connected(self, obj):
        if not obj.n_connections:
            return count_badge(0, None)
        url = (
            reverse("admin:subscribers_connection_changelist")
            + "?"
            + urlencode({"subscriber__id__exact": obj.pk})
        )
        return format_html('<a href="{}"><strong>{}</strong></a>', url, obj.n_connections)

    @admin.display(description="what it is owed")
    def owed(self, obj):
        if obj is None or obj.pk is None:
            return "-"
        rows = owed_to_subscriber(obj)
        if not rows:
            return "Nothing: it has no subscriptions."

        def cell(count, status, subscription):
            if not count:
                return count_badge(0, status)
            filters = {"subscriber__id__exact": obj.pk, "status__exact": status}
            if subscription is not None:
                filters["subscription__id__exact"] = subscription.pk
            return format_html('<a href="{}">{}</a>', deliveries_url(**filters), count_badge(count, status))

        body = format_html_join(
            "",
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            (
                (
                    admin_link(o.subscription, f"{o.subscription.queue.name}/{_event_name(o.subscription)}")
                    if o.subscription is not None
                    else "(no subscription)",
                    cell(o.pending, Status.PENDING, o.subscription),
                    cell(o.inflight, Status.INFLIGHT, o.subscription),
                    cell(o.dead, Status.DEAD, o.subscription),
                    age(o.oldest_pending_age()),
                    why_owed_html(obj, o),
                )
                for o in rows
            ),
        )
        return format_html(
            '<table class="mq-owed"><thead><tr><th>subscription</th><th>pending</th><th>in flight</th>'
            "<th>dead</th><th>oldest pending</th><th>why</th></tr></thead><tbody>{}</tbody></table>",
            body,
        )


# What the subscriber list reads of each webhook's health (SubscriberAdmin.get_queryset).
WEBHOOK_STATE_FIELDS = ("failures", "first_failure_at", "disabled_since", "disabled_after")


def webhook_state_html(subscriber, health, long=False):
    """Its webhook as delivery.webhook_health keeps it (`health`, None when nothing was
    recorded): disabled (since when, after how many failures, with the last error), failing,
    or working."""
    if not subscriber.webhook_url:
        return "-"
    if health is None:
        return "no post yet" if long else "ok"
    if health.disabled:
        badge = format_html(
            '<span class="mq-webhook-disabled" style="background:#b3261e;color:#fff;padding:1px 7px;'
            'border-radius:9px;font-size:11px">disabled</span> since {} after {} failures',
            display_for_value(health.disabled_since, "-"),
            health.disabled_after if health.disabled_after is not None else health.failures,
        )
        if not long:
            return badge
        return format_html(
            "{}; last error: <code>{}</code>. Its deliveries stay owed; the action \u201cEnable the "
            "webhook again\u201d (or <code>manage.py webhook enable {}</code>) delivers them.",
            badge,
            health.last_error[:300] or "-",
            subscriber.name,
        )
    if health.failures:
        words = format_html(
            "failing: {} failures in a row since {}",
            health.failures,
            display_for_value(health.first_failure_at, "-"),
        )
        return (
            format_html("{}; last error: <code>{}</code>", words, health.last_error[:300]) if long else words
        )
    last = display_for_value(health.last_success_at, "-")
    return format_html("ok (last success {})", last) if long else "ok"


def why_owed_html(subscriber, owed):
    """The reasons of delivery.reports.why_owed as a list, each with when its wait ends, the last
    error, and for a blocked ordered subscription a link to its head of line."""
    if not owed.reasons:
        return "nothing owed"
    now = timezone.now()
    return format_html(
        '<ul class="mq-why">{}</ul>',
        format_html_join(
            "",
            '<li data-reason="{}">{}{}{}{}</li>',
            (
                (
                    r.code,
                    r.words,
                    _until(r.until, now),
                    format_html("; last error: <code>{}</code>", r.error[:300]) if r.error else "",
                    _head_of_line_link(subscriber, owed) if r.code == "blocked" else "",
                )
                for r in owed.reasons
            ),
        ),
    )


def _until(at, now):
    if at is None:
        return ""
    when = display_for_value(at, "-")
    if at >= now:
        return format_html(" until {} (in {})", when, age(at - now))
    return format_html(" until {} (overdue by {}: the sweep takes it back)", when, age(now - at))


def _head_of_line_link(subscriber, owed):
    url = (
        reverse("mq-head-of-line")
        + "?"
        + urlencode({"subscriber": subscriber.pk, "queue": owed.subscription.queue_id})
    )
    return format_html(' (<a href="{}">head of line: retry it now or skip it</a>)', url)


def _event_name(subscription):
    return subscription.event.name if subscription.event_id else "*"


class ReplayFromForm(forms.Form):
    """The point a "replay from" action seeks the selected subscriptions back to."""

    start = forms.CharField(
        label="Replay from",
        max_length=replay.MAX_TIME_CHARS,
        help_text='"all" (every message still kept), a seq (e.g. 120), or an ISO 8601 time '
        "(e.g. 2026-11-24T14:00:00Z; without an offset, UTC).",
    )

    def clean_start(self):
        try:
            point = replay.point_of_text(self.cleaned_data["start"])
        except replay.BadPoint as exc:
            raise forms.ValidationError(exc.detail) from None
        if point.kind == replay.NEW:
            raise forms.ValidationError('"new" replays nothing: give "all", a seq or a time.')
        return point


@admin.register(Subscription)
class SubscriptionAdmin(DeliveryCountColumns, admin.ModelAdmin):
    form = SubscriptionFilterForm
    list_display = [
        "id",
        "subscriber",
        "queue_name",
        "event_name",
        "state",
        "pending",
        "inflight",
        "dead",
        "created_at",
    ]
    list_filter = ["paused", "queue"]
    list_select_related = ["subscriber", "queue", "event"]
    search_fields = ["subscriber__name", "queue__name", "event__name"]
    autocomplete_fields = ["subscriber"]
    fields = ["subscriber", "queue", "event", "filter_json", "state", "created_at", "owed"]
    actions = ["replay_from", "pause", "resume"]

    def get_readonly_fields(self, request, obj=None):
        if obj is None:
            return ["created_at", "owed"]
        return ["subscriber", "queue", "event", "state", "created_at", "owed"]

    def get_fields(self, request, obj=None):
        if obj is None:
            return ["subscriber", "queue", "event", "filter_json"]
        return self.fields

    def save_model(self, request, obj, form, change):
        # The filter is stored as clause rows beside the row (subscribers.filters), in one
        # transaction with it; the history says "Changed filter." as for any field.
        with transaction.atomic():
            super().save_model(request, obj, form, change)
            subscribing.set_filter(obj, form.cleaned_data.get("filter_json"))

    def formfield_for_foreignkey(self, db_field, request, **kwargs):
        if db_field.name == "event":
            kwargs["queryset"] = Event.objects.select_related("queue").order_by("queue__name", "name")
        return super().formfield_for_foreignkey(db_field, request, **kwargs)

    def get_queryset(self, request):
        return with_delivery_counts(super().get_queryset(request), "subscription")

    @admin.display(description="queue", ordering="queue__name")
    def queue_name(self, obj):
        return obj.queue.name

    @admin.display(description="event", ordering="event__name")
    def event_name(self, obj):
        return _event_name(obj)

    @admin.display(description="what it is owed")
    def owed(self, obj):
        return owed_links(obj, subscription__id__exact=obj.pk)

    @admin.display(description="state", ordering="paused")
    def state(self, obj):
        return paused_badge(obj.paused)

    @admin.action(description="Pause: keep owing what is published, hand out nothing", permissions=["change"])
    def pause(self, request, queryset):
        self._pause_or_resume(request, queryset, subscribing.pause, "paused")

    @admin.action(description="Resume: hand out what is owed again", permissions=["change"])
    def resume(self, request, queryset):
        self._pause_or_resume(request, queryset, subscribing.resume, "resumed")

    def _pause_or_resume(self, request, queryset, change, done):
        """Each one it changed is written in its admin history, as a replay from here is. (The
        list's queryset carries counts, which a row lock may not: its ids are taken.)"""
        ids = change(Subscription.objects.filter(pk__in=queryset.values("pk")))
        for subscription in Subscription.objects.filter(pk__in=ids).select_related(
            "subscriber", "queue", "event"
        ):
            self.log_change(request, subscription, done)
        self.message_user(request, f"{len(ids)} subscriptions {done}.")

    def delete_model(self, request, obj):
        subscribing.unsubscribe(obj)

    def delete_queryset(self, request, queryset):
        for subscription in queryset:
            subscribing.unsubscribe(subscription)

    def has_operate_permission(self, request):
        # A replay moves deliveries (acked ones handed out again): the right to change them.
        return request.user.has_perm("delivery.change_delivery")

    @admin.action(
        description="Replay from a seq or a time (hand out again what the queue still holds)",
        permissions=["operate"],
    )
    def replay_from(self, request, queryset):
        """Asks for the point first (a form on a page of its own, which posts back to this
        list), then seeks each selected subscription back to it (subscribing.seek)."""
        form = ReplayFromForm(request.POST if "start" in request.POST else None)
        if not form.is_valid():
            context = {
                **self.admin_site.each_context(request),
                "title": "Replay from a seq or a time",
                "opts": self.model._meta,
                "form": form,
                "subscriptions": queryset.select_related("subscriber", "queue", "event").order_by("id")[:100],
                "count": queryset.count(),
                "selected": request.POST.getlist(ACTION_CHECKBOX_NAME),
                "select_across": request.POST.get("select_across", "0"),
                "action_checkbox_name": ACTION_CHECKBOX_NAME,
                "action": "replay_from",
            }
            request.current_app = self.admin_site.name
            return TemplateResponse(request, "admin/subscribers/subscription/replay_from.html", context)
        point = form.cleaned_data["start"]
        done = []
        for subscription in queryset.select_related("subscriber", "queue", "event").order_by("id"):
            try:
                replayed = subscribing.seek(subscription, point)
            except limits.LimitExceeded as exc:  # a replay of it under way: say so, go on
                self.message_user(request, f"{subscription}: {exc.detail}", messages.WARNING)
                continue
            words = f"replayed from seq {replayed.from_seq}: {replayed.deliveries} deliveries owed again"
            self.log_change(request, subscription, words)
            done.append((subscription, words, replayed.deliveries))
        if len(done) == 1:
            self.message_user(request, f"{done[0][0]}: {done[0][1]}.")
        else:
            owed = sum(n for _, _, n in done)
            self.message_user(request, f"{len(done)} subscriptions replayed: {owed} deliveries owed again.")
        return None


class HeartbeatFilter(admin.SimpleListFilter):
    title = "heartbeat"
    parameter_name = "heartbeat"

    def lookups(self, request, model_admin):
        return [("live", "live"), ("stale", f"stale (none for {STALE_AFTER_SECS} s)")]

    def queryset(self, request, queryset):
        if self.value() == "live":
            return queryset.live(timezone.now())
        if self.value() == "stale":
            return queryset.stale(timezone.now())
        return queryset


@admin.register(Connection)
class ConnectionAdmin(DeliveryCountColumns, admin.ModelAdmin):
    """Connected now: who has a websocket open, what it receives, and what its subscriber is
    still owed. Presence makes and removes the rows; a superuser may close one here."""

    list_display = [
        "subscriber_link",
        "connected_at",
        "last_seen_badge",
        "remote_addr",
        "receives",
        "pending",
        "oldest_pending",
        "inflight",
    ]
    list_display_links = ["connected_at"]
    list_filter = [HeartbeatFilter]
    search_fields = ["subscriber__name", "remote_addr", "channel_name"]
    fields = [
        "subscriber_link",
        "channel_name",
        "remote_addr",
        "connected_at",
        "last_seen_badge",
        "receives",
        "pending",
        "oldest_pending",
        "inflight",
    ]
    readonly_fields = fields

    def get_queryset(self, request):
        # What each receives: one query for the page's subscribers; the backlog: subqueries.
        subscriptions = Subscription.objects.select_related("queue", "event").order_by(
            "queue__name", F("event__name").asc(nulls_first=True), "id"
        )
        return (
            super()
            .get_queryset(request)
            .select_related("subscriber")
            .prefetch_related(Prefetch("subscriber__subscriptions", queryset=subscriptions))
            .annotate(**subscriber_backlog("subscriber_id"))
        )

    def changelist_view(self, request, extra_context=None):
        return super().changelist_view(request, {"title": "Connected now", **(extra_context or {})})

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return request.user.is_active and request.user.is_superuser

    def delete_model(self, request, obj):
        self.delete_queryset(request, [obj])

    def delete_queryset(self, request, queryset):
        names = [connection.channel_name for connection in queryset]
        presence.close_connections(names)
        # The socket itself closes, in whichever server process holds it.
        if names:
            bus.send_after_commit(bus.CHANGED, {"connections": sorted(set(names))})

    @admin.display(description="subscriber", ordering="subscriber__name")
    def subscriber_link(self, obj):
        return admin_link(obj.subscriber)

    @admin.display(description="last seen", ordering="last_seen")
    def last_seen_badge(self, obj):
        return heartbeat(obj)

    @admin.display(description="receives")
    def receives(self, obj):
        subscriptions = obj.subscriber.subscriptions.all()
        if not subscriptions:
            return "nothing (no subscriptions)"
        return format_html_join(
            ", ",
            "{}{}",
            (
                (
                    admin_link(s, f"{s.queue.name}/{_event_name(s)}"),
                    " (paused: receives nothing)" if s.paused else "",
                )
                for s in subscriptions
            ),
        )
