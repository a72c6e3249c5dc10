"""The outbox and the handled deliveries, for staff to look at: read only (the relay alone
changes a row)."""

from django.contrib import admin

from .models import OutboxMessage, ReceivedDelivery


class ReadOnly(admin.ModelAdmin):
    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(OutboxMessage)
class OutboxMessageAdmin(ReadOnly):
    list_display = ("id", "queue", "event", "status", "created_at", "sent_at", "attempts", "last_error")
    list_filter = ("status", "queue")
    search_fields = ("event", "last_error")
    date_hierarchy = "created_at"


@admin.register(ReceivedDelivery)
class ReceivedDeliveryAdmin(ReadOnly):
    list_display = ("id", "queue", "event", "received_at")
    list_filter = ("queue",)
