from django.contrib import admin
from django.urls import include, path
from drf_spectacular.renderers import (
    OpenApiJsonRenderer,
    OpenApiJsonRenderer2,
    OpenApiYamlRenderer,
    OpenApiYamlRenderer2,
)
from drf_spectacular.views import SpectacularSwaggerSplitView

from analytics.api.views import AnalyticsView
from dashboard.metrics import metrics
from dashboard.urls import admin_tools
from delivery.api.queue_views import EventCatalogView, MessagesView, QueueListView, RouteView
from delivery.api.subscription_views import (
    ConnectionListView,
    SubscriptionDetailView,
    SubscriptionListView,
    SubscriptionPauseView,
    SubscriptionResumeView,
    SubscriptionSeekView,
)
from delivery.api.views import AckView, DeliveryListView, ExtendView, MessageView, NackView

from .health import healthz
from .schema import SchemaView

# JSON unless YAML is asked for (Accept or ?format=yaml): what most clients parse first.
schema_view = SchemaView.as_view(
    renderer_classes=[OpenApiJsonRenderer, OpenApiJsonRenderer2, OpenApiYamlRenderer, OpenApiYamlRenderer2]
)

api = [
    path("queues", QueueListView.as_view(), name="queue-list"),
    path("queues/<str:queue>/messages", MessagesView.as_view(), name="messages"),
    path("queues/<str:queue>/events", EventCatalogView.as_view(), name="event-catalog"),
    path("queues/<str:queue>/route", RouteView.as_view(), name="route"),
    path("messages/<int:id>", MessageView.as_view(), name="message-detail"),
    path("subscriptions", SubscriptionListView.as_view(), name="subscription-list"),
    path("subscriptions/<int:pk>", SubscriptionDetailView.as_view(), name="subscription-detail"),
    path("subscriptions/<int:pk>/seek", SubscriptionSeekView.as_view(), name="subscription-seek"),
    path("subscriptions/<int:pk>/pause", SubscriptionPauseView.as_view(), name="subscription-pause"),
    path("subscriptions/<int:pk>/resume", SubscriptionResumeView.as_view(), name="subscription-resume"),
    path("deliveries", DeliveryListView.as_view(), name="delivery-list"),
    path("deliveries/ack", AckView.as_view(), name="delivery-ack"),
    path("deliveries/extend", ExtendView.as_view(), name="delivery-extend"),
    path("deliveries/<int:pk>/nack", NackView.as_view(), name="delivery-nack"),
    path("connections", ConnectionListView.as_view(), name="connection-list"),
    path("analytics", AnalyticsView.as_view(), name="analytics"),
    path("schema/", schema_view, name="schema"),
    # The split view serves Swagger UI's start-up script as a file of its own (?script), not
    # inline, so that the page runs under the Content-Security-Policy (script-src 'self').
    path("docs/", SpectacularSwaggerSplitView.as_view(url_name="schema"), name="docs"),
]

urlpatterns = [
    path("admin/tools/", include(admin_tools)),
    path("admin/", admin.site.urls),
    path("healthz", healthz, name="healthz"),
    path("metrics", metrics, name="metrics"),
    path("api/", include(api)),
    path("", include("dashboard.urls")),
]

handler400 = "mqsite.errors.bad_request"
handler403 = "mqsite.errors.permission_denied"
handler404 = "mqsite.errors.not_found"
handler500 = "mqsite.errors.server_error"
