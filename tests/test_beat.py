"""The beat schedule: made from the settings once, then the operators' (django-celery-beat's
Periodic tasks in the admin)."""

from django_celery_beat.models import IntervalSchedule, PeriodicTask

from mqsite.beat import OperatorEditableScheduler
from mqsite.celery import app


def start_beat():
    OperatorEditableScheduler(app=app, lazy=True).setup_schedule()


def test_a_first_start_makes_the_settings_schedule(transactional_db):
    start_beat()

    sweep = PeriodicTask.objects.get(name="sweep")
    assert sweep.task == "delivery.tasks.sweep" and sweep.enabled
    assert (sweep.interval.every, sweep.interval.period) == (1, IntervalSchedule.SECONDS)
    assert PeriodicTask.objects.get(name="archive").interval.every == 3600


def test_what_an_operator_changed_in_the_admin_survives_a_restart(transactional_db):
    start_beat()
    archive = PeriodicTask.objects.get(name="archive")
    archive.interval, _ = IntervalSchedule.objects.get_or_create(every=600, period=IntervalSchedule.SECONDS)
    archive.save()
    PeriodicTask.objects.filter(name="sweep").update(enabled=False)

    start_beat()

    assert PeriodicTask.objects.get(name="archive").interval.every == 600
    assert not PeriodicTask.objects.get(name="sweep").enabled


def test_a_deleted_entry_comes_back_as_the_settings_say(transactional_db):
    start_beat()
    PeriodicTask.objects.filter(name="sweep").delete()

    start_beat()

    assert PeriodicTask.objects.get(name="sweep").interval.every == 1
