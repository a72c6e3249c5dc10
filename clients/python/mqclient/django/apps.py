from django.apps import AppConfig


class MQClientConfig(AppConfig):
    name = "mqclient.django"
    label = "mqclient"  # "django", the last part of the name, would read as Django's own
    verbose_name = "Message queue"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.utils.module_loading import autodiscover_modules

        from . import checks, model_events  # noqa: F401 - checks registers itself

        model_events.connect()
        # Handlers register themselves when their module is imported: each app's mq_handlers.
        autodiscover_modules("mq_handlers")
