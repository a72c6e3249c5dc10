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


def test_the_analysis_runs_on_beat_on_a_queue_of_its_own(transactional_db, settings):
    start_beat()

    analyze = PeriodicTask.objects.get(name="analyze")
    assert analyze.task == "analytics.tasks.analyze" and analyze.enabled
    assert analyze.interval.every == settings.MQ_ANALYZE_EVERY_SECS == 3600
    # ... not on the sweeper's queue: a Spark run of minutes must not hold up a sweep
    assert app.amqp.router.route({}, "analytics.tasks.analyze")["queue"].name == "analytics"
    assert app.amqp.router.route({}, "delivery.tasks.sweep")["queue"].name == "maintenance"


def test_an_interval_an_operator_gave_the_analysis_survives_a_restart(transactional_db):
    start_beat()
    analyze = PeriodicTask.objects.get(name="analyze")
    analyze.interval, _ = IntervalSchedule.objects.get_or_create(every=900, period=IntervalSchedule.SECONDS)
    analyze.save()

    start_beat()

    assert PeriodicTask.objects.get(name="analyze").interval.every == 900
