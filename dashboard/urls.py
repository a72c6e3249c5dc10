from django.contrib import admin
from django.urls import path

from . import admin_views, views

urlpatterns = [
    path("", views.index, name="dashboard"),
    path("dashboard/dead/<int:pk>/redeliver", views.redeliver_dead, name="dashboard-redeliver"),
]

# Mounted under /admin/tools/, ahead of the admin itself: the admin's login and staff check
# (admin_view), its CSRF protection and its look.
admin_tools = [
    path("head-of-line/", admin.site.admin_view(admin_views.head_of_line), name="mq-head-of-line"),
    path("publish/", admin.site.admin_view(admin_views.publish_test_message), name="mq-publish"),
]
