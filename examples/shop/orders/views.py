"""The shop's API: plain Django JSON views. Saving an order is all it takes to publish it: the
model event writes the outbox row in the same transaction (ATOMIC view, below)."""

import json

from django.db import transaction
from django.http import HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_http_methods

from .models import Order


def _bad(message):
    return JsonResponse({"error": message}, status=400)


# An example API without logins: a real one authenticates its callers (and keeps CSRF for cookies).
@csrf_exempt
@require_http_methods(["GET", "POST"])
def orders(request):
    if request.method == "GET":
        return JsonResponse({"orders": [o.as_json() for o in Order.objects.order_by("-id")[:50]]})
    try:
        body = json.loads(request.body or b"null")
    except ValueError:
        return _bad("the body is not JSON")
    if not isinstance(body, dict):
        return _bad('send {"item": "...", "quantity": N}')
    item, quantity = body.get("item"), body.get("quantity", 1)
    if not isinstance(item, str) or not 0 < len(item.strip()) <= 100:
        return _bad("item: a name of 1 to 100 characters")
    if not isinstance(quantity, int) or isinstance(quantity, bool) or not 0 < quantity <= 1000:
        return _bad("quantity: a whole number from 1 to 1000")
    # The order and its db/create outbox row commit together, or neither does.
    with transaction.atomic():
        order = Order.objects.create(item=item.strip(), quantity=quantity)
    return JsonResponse(order.as_json(), status=201)


@csrf_exempt
@require_http_methods(["GET", "DELETE"])
def order(request, pk):
    found = get_object_or_404(Order, pk=pk)
    if request.method == "DELETE":
        found.delete()  # published as db/delete
        return HttpResponse(status=204)
    return JsonResponse({**found.as_json(), "shipped": hasattr(found, "shipment")})
