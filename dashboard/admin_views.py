"""Operator tools inside the admin (its login, look and history), mounted at /admin/tools/:

- Head of line: for ordered queues, the delivery at the head of each subscription that holds
  the others back, with "retry now" and "skip". Both go through delivery.ledger; each choice
  is written on the delivery (its last_error) and in the admin's history (LogEntry).
- Publish a test message: queue, event, JSON payload, key and headers, through delivery.publishing.
"""

import json

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.html import format_html

from delivery import ledger, observe, publishing, reports
from delivery.models import Delivery, Status
from queues.headers import BadHeaders, headers_of_pairs
from queues.models import Message, Queue
from subscribers.models import Subscriber


def may_operate(user):
    return user.has_perm("delivery.change_delivery")


def _context(request, title, **extra):
    return {**admin.site.each_context(request), "title": title, **extra}


def _int(value):
    return int(value) if isinstance(value, str) and value.isdigit() and len(value) < 19 else None


# --- head of line ------------------------------------------------------------------------------


def head_of_line(request):
    if not (request.user.has_perm("delivery.view_delivery") or may_operate(request.user)):
        raise PermissionDenied
    if request.method == "POST":
        return _act_on_head(request)
    subscriber = Subscriber.objects.filter(pk=_int(request.GET.get("subscriber", ""))).first()
    queue = Queue.objects.filter(pk=_int(request.GET.get("queue", ""))).first()
    found = reports.blocked_heads(subscriber=subscriber, queue=queue)
    ordered = list(Queue.objects.filter(ordered=True).values_list("name", flat=True))
    return TemplateResponse(
        request,
        "dashboard/admin/head_of_line.html",
        _context(
            request,
            "Head of line: what holds ordered subscriptions back",
            heads=found,
            subscriber=subscriber,
            queue=queue,
            ordered_queues=ordered,
            may_operate=may_operate(request.user),
            STATUS=Status,
        ),
    )


def _act_on_head(request):
    if not may_operate(request.user):
        raise PermissionDenied
    back = request.get_full_path()
    action = request.POST.get("action")
    delivery = (
        Delivery.objects.select_related("queue", "subscriber")
        .filter(pk=_int(request.POST.get("delivery", "")))
        .first()
    )
    if delivery is None or action not in ("retry", "skip"):
        messages.error(request, "Choose a delivery and retry or skip.")
        return HttpResponseRedirect(back)
    # A head of one of its subscription's lines (one per message group), still open.
    if not Delivery.objects.filter(pk=delivery.pk).heads().exists():
        messages.warning(
            request,
            f"Delivery {delivery.pk} is no longer at the head of its line "
            f"(it is {delivery.status}): nothing done.",
        )
        return HttpResponseRedirect(back)
    operator = request.user.get_username()
    which = Delivery.objects.filter(pk=delivery.pk)
    if action == "retry":
        moved = ledger.retry_now(which, reason=ledger.retried_now_by(operator))
        done = "retried now: pending, ready at once"
    else:
        moved = ledger.skip_deliveries(which, operator)
        done = f"skipped: dead, 'skipped by {operator}'"
    if not moved:
        messages.warning(request, f"Delivery {delivery.pk} was settled meanwhile: nothing done.")
        return HttpResponseRedirect(back)
    where = f"{delivery.queue.name}#{delivery.seq} for {delivery.subscriber.name}"
    admin.site.get_model_admin(Delivery).log_change(
        request, delivery, f"Head of line of an ordered subscription ({where}) {done}."
    )
    messages.success(request, f"Delivery {delivery.pk} ({where}) {done}.")
    return HttpResponseRedirect(back)


# --- publish a test message ---------------------------------------------------------------------


class PublishForm(forms.Form):
    queue = forms.ModelChoiceField(queryset=Queue.objects.order_by("name"), empty_label=None)
    event = forms.CharField(initial="test", max_length=64, help_text="Made on first publish.")
    payload = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 8, "cols": 60, "class": "vLargeTextField"}),
        initial='{"hello": "world"}',
        help_text="Any JSON value, null included.",
    )
    key = forms.CharField(
        required=False,
        max_length=255,
        help_text="Optional idempotency key: the same key again publishes nothing.",
    )
    headers = forms.CharField(
        required=False,
        strip=False,  # a value is kept as typed
        widget=forms.Textarea(attrs={"rows": 3, "cols": 60, "class": "vLargeTextField"}),
        help_text="Optional headers: one NAME=VALUE a line, or a JSON object of names to text.",
    )

    def clean_payload(self):
        try:
            return json.loads(self.cleaned_data["payload"])
        except ValueError as exc:
            raise forms.ValidationError(f"This is not JSON: {exc}") from None
        except RecursionError:
            raise forms.ValidationError("This JSON is nested too deeply.") from None

    def clean_headers(self):
        text = self.cleaned_data["headers"]
        if text.strip().startswith("{"):
            try:
                return json.loads(text)
            except ValueError as exc:
                raise forms.ValidationError(f"This is not a JSON object: {exc}") from None
            except RecursionError:
                raise forms.ValidationError("This JSON is nested too deeply.") from None
        try:
            return headers_of_pairs(line.rstrip("\r") for line in text.split("\n") if line.strip())
        except BadHeaders as exc:
            raise forms.ValidationError(str(exc)) from None

    def clean(self):
        cleaned = super().clean()
        if self.errors:
            return cleaned
        try:
            cleaned["outgoing"] = publishing.prepare(
                cleaned["event"], cleaned["payload"], cleaned["key"] or None, cleaned["headers"]
            )
            publishing.check_schemas(cleaned["queue"], [cleaned["outgoing"]])
        except publishing.BadMessageHeaders as exc:
            self.add_error("headers", str(exc))
        except publishing.SchemaMismatch as exc:
            self.add_error("payload", [f"{e['path'] or '(the payload)'}: {e['message']}" for e in exc.errors])
        except publishing.BadMessage as exc:
            raise forms.ValidationError(str(exc)) from None
        return cleaned


def publish_test_message(request):
    if not request.user.has_perm("queues.add_message"):
        raise PermissionDenied
    initial = {}
    chosen = Queue.objects.filter(pk=_int(request.GET.get("queue", ""))).first()
    if chosen is not None:
        initial["queue"] = chosen
    form = PublishForm(request.POST or None, initial=initial)
    if request.method == "POST" and form.is_valid():
        queue = form.cleaned_data["queue"]
        with observe.publishing("admin"):
            [(answer, created)] = publishing.publish(
                queue, [form.cleaned_data["outgoing"]], publisher=None, checked=True
            )
        message = Message.objects.get(pk=answer["id"])
        url = reverse("admin:queues_message_change", args=[message.pk])
        if created:
            admin.site.get_model_admin(Message).log_addition(
                request, message, f"Published as a test message from the admin to {queue.name}."
            )
            messages.success(
                request,
                format_html(
                    'Published <a href="{}">message {}</a> to {}/{} as seq {}: {} deliveries.',
                    url,
                    answer["id"],
                    answer["queue"],
                    answer["event"],
                    answer["seq"],
                    answer["deliveries"],
                ),
            )
        else:
            messages.info(
                request,
                format_html(
                    'That key was used already: <a href="{}">message {}</a>. Nothing new.', url, message.pk
                ),
            )
        return HttpResponseRedirect(f"{request.path}?queue={queue.pk}")
    return TemplateResponse(
        request,
        "dashboard/admin/publish.html",
        _context(request, "Publish a test message", form=form),
    )
