"""The beat scheduler: django-celery-beat's, keeping what operators change in the admin."""

from django_celery_beat.models import PeriodicTask
from django_celery_beat.schedulers import DatabaseScheduler


class OperatorEditableScheduler(DatabaseScheduler):
    """django-celery-beat writes CELERY_BEAT_SCHEDULE over its table at every start, so an
    interval an operator changed in the admin (Periodic tasks), or a task they disabled, came
    back as the settings say at the next restart. Here the settings only make the entries that
    are missing; an entry in the table is the operator's and is kept (delete it to get the
    settings' again)."""

    def update_from_dict(self, mapping):
        kept = set(PeriodicTask.objects.filter(name__in=list(mapping)).values_list("name", flat=True))
        super().update_from_dict({name: entry for name, entry in mapping.items() if name not in kept})
