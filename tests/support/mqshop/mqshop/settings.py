"""The settings a user's project would have, from the environment the test gives it."""

import os

SECRET_KEY = "test only"
DEBUG = False
ALLOWED_HOSTS = ["*"]
USE_TZ = True
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "mqclient.django",
    "shop",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "django.template.context_processors.request",
            ]
        },
    }
]
ROOT_URLCONF = "mqshop.urls"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("SHOP_DB", "shop.sqlite3"),
        "OPTIONS": {"timeout": 20},
    }
}
if os.environ.get("SHOP_PG"):
    DATABASES["default"] = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ["SHOP_PG"],
        "USER": "postgres",
        "HOST": "127.0.0.1",
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
MQ = {
    "URL": os.environ.get("MQ_URL", "http://127.0.0.1:8000"),
    "TOKEN": os.environ.get("MQ_TOKEN", ""),
    "WEBHOOK_SECRET": os.environ.get("MQ_WEBHOOK_SECRET"),
    "MODEL_EVENTS": {"shop.Order": {"queue": "db", "events": ["create", "update", "delete"]}},
    "RELAY_ON_COMMIT": os.environ.get("SHOP_RELAY_ON_COMMIT", "1") == "1",
    "RELAY_BATCH": int(os.environ.get("SHOP_RELAY_BATCH", "100")),
    "RELAY_INTERVAL_SECS": 0.1,
    "OUTBOX_RETENTION_SECS": float(os.environ.get("SHOP_RETENTION_SECS", 7 * 24 * 3600)),
}
LOGGING = {
    "version": 1,
    "handlers": {"stderr": {"class": "logging.StreamHandler"}},
    "loggers": {"mqclient": {"handlers": ["stderr"], "level": os.environ.get("SHOP_LOG_LEVEL", "WARNING")}},
}
