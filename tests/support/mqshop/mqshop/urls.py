import mqclient.django
from django.contrib import admin
from django.urls import path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("mq/webhook/", mqclient.django.webhook_view),
]
