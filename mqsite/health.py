import os

from django.conf import settings
from django.db import connection
from django.http import JsonResponse


def _database():
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")


def _job_carrier():
    """What carries Celery's jobs: Redis in the services mode, a folder in the embedded one."""
    if settings.REDIS_URL:
        import redis

        redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=2, socket_timeout=2).ping()
    else:
        folder = settings.CELERY_QUEUE_DIR / "queue"
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise OSError(f"{folder} is not a writable folder")


# The checks of the processes that do the work, registered by the app that knows them
# (delivery's AppConfig.ready: delivery.health): fn() -> ({name: figures}, [what is wrong]).
_process_checks = []


def register(fn):
    if fn not in _process_checks:
        _process_checks.append(fn)


def healthz(request):
    """200 when the database and what carries Celery's jobs answer and, where workers should
    run (MQ_HEALTH_WORKERS), a worker is alive and the sweep ran within MQ_HEALTH_SWEEP_SECS;
    503 otherwise. The first two stay at the top level too, as they always were."""
    basics = {}
    for name, check in (("database", _database), ("jobs", _job_carrier)):
        try:
            check()
            basics[name] = "ok"
        except Exception as exc:  # any failure to reach it is the answer, not an error
            basics[name] = f"unavailable: {exc.__class__.__name__}"
    checks = {"database": basics["database"], "broker": basics["jobs"]}
    wrong = [name for name, value in basics.items() if value != "ok"]
    if not wrong:  # the processes' rows are in the database: read only when it answers
        for check in _process_checks:
            figures, problems = check()
            checks.update(figures)
            if settings.MQ_HEALTH_WORKERS:
                wrong += problems
    mode = "services" if settings.REDIS_URL else "embedded"
    body = {"status": "unavailable" if wrong else "ok", "mode": mode, **basics, "checks": checks}
    if wrong:
        body["problems"] = wrong
    return JsonResponse(body, status=503 if wrong else 200)
