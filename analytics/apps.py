from django.apps import AppConfig


class AnalyticsConfig(AppConfig):
    name = "analytics"
    verbose_name = "analytics"

    def ready(self):
        # The dashboard shows these figures without importing this app (mqsite.readers).
        from mqsite import readers

        from . import summaries

        readers.provide("analytics.history", summaries.history)
        readers.provide("analytics.metrics", summaries.metrics)
