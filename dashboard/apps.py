from django.apps import AppConfig


class DashboardConfig(AppConfig):
    """The operators' live dashboard at /, its websocket, the admin's operator tools (head of
    line of ordered queues, publish a test message) and the demo. It owns no model: it reads
    through dashboard.snapshot and changes state only through delivery.ledger and publishing."""

    name = "dashboard"
    verbose_name = "operator tools"
