"""The dashboard page at / and its one action: redeliver a dead letter.

The page is static HTML; what it shows arrives over /ws/dashboard/ (dashboard.consumers).
"""

from django.conf import settings
from django.contrib import admin
from django.contrib.admin.views.decorators import staff_member_required
from django.http import JsonResponse
from django.shortcuts import render
from django.views.decorators.http import require_POST

from delivery import ledger
from delivery.models import Delivery, Status
from mqsite.errors import error_json
from subscribers.auth import operator_may

from . import snapshot


@staff_member_required(login_url="admin:login")
def index(request):
    return render(
        request,
        "dashboard/index.html",
        {
            "may_redeliver": request.user.has_perm("delivery.change_delivery"),
            "tick_secs": 1,
            "rate_window_secs": snapshot.RATE_WINDOW_SECS,
            "series_window_secs": snapshot.SERIES_WINDOW_SECS,
            "debug": settings.DEBUG,
        },
    )


@require_POST
def redeliver_dead(request, pk):
    """Put one dead delivery back to pending, ready now, through the ledger (a POST from the
    page, with its CSRF token). Answers JSON: the page calls it with fetch()."""
    user = request.user
    if not operator_may(user):
        return error_json("Log in as an operator (staff) first.", "forbidden", 403)
    if not user.has_perm("delivery.change_delivery"):
        return error_json("You may not change deliveries.", "forbidden", 403)
    delivery = Delivery.objects.filter(pk=pk).first()
    if delivery is None:
        return error_json(f"There is no delivery {pk}.", "not_found", 404)
    if delivery.status != Status.DEAD:
        return error_json(f"Delivery {pk} is {delivery.status}, not dead.", "not_dead", 409)
    moved = ledger.redeliver(Delivery.objects.filter(pk=pk, status=Status.DEAD))
    if moved:
        # Recorded as the admin's own redeliver action would be: in the admin's history.
        admin.site.get_model_admin(Delivery).log_change(
            request, delivery, "Redelivered from the dashboard (back to pending, ready now)."
        )
    return JsonResponse({"redelivered": moved})
