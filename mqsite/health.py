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


def healthz(request):
    """200 when the database and what carries Celery's jobs answer; 503 otherwise."""
    checks = {}
    for name, check in (("database", _database), ("jobs", _job_carrier)):
        try:
            check()
            checks[name] = "ok"
        except Exception as exc:  # any failure to reach it is the answer, not an error
            checks[name] = f"unavailable: {exc.__class__.__name__}"
    ok = all(v == "ok" for v in checks.values())
    mode = "services" if settings.REDIS_URL else "embedded"
    return JsonResponse(
        {"status": "ok" if ok else "unavailable", "mode": mode, **checks}, status=200 if ok else 503
    )
