import mqclient.django
from django.contrib import admin
from django.urls import path
from orders import views

urlpatterns = [
    path("orders/", views.orders),
    path("orders/<int:pk>/", views.order),
    # The server posts queue db's deliveries here; orders/mq_handlers.py handles them.
    path("mq/webhook/", mqclient.django.webhook_view),
    path("admin/", admin.site.urls),
]
