"""Settings of the example shop: a Django project of its own that publishes its orders to the
message-queue server and receives them back on its webhook (README.md).

Everything that differs between machines comes from the environment:
MQ_URL, MQ_TOKEN, MQ_WEBHOOK_SECRET (what `createsubscriber --json` printed), SHOP_DB."""

import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent

# An example: a fixed key is fine on a laptop, never in production.
SECRET_KEY = os.environ.get("SHOP_SECRET_KEY", "example-shop-not-for-production")
DEBUG = os.environ.get("SHOP_DEBUG", "false").lower() == "true"
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
USE_TZ = True
TIME_ZONE = "UTC"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "mqclient.django",  # the outbox, the relay, the webhook view (docs/clients/django.md)
    "orders",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
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
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
ROOT_URLCONF = "shopsite.urls"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("SHOP_DB", BASE_DIR / "shop.sqlite3"),
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

MQ = {
    "URL": os.environ.get("MQ_URL", "http://127.0.0.1:8000"),
    # The token of the subscriber the shop publishes as (createsubscriber shop --publish db).
    "TOKEN": os.environ.get("MQ_TOKEN", ""),
    # The whsec_... secret the server signs its posts to mq/webhook/ with.
    "WEBHOOK_SECRET": os.environ.get("MQ_WEBHOOK_SECRET"),
    # Every save and delete of an Order is published to queue db, in the saving transaction.
    "MODEL_EVENTS": {"orders.Order": {"queue": "db", "events": ["create", "update", "delete"]}},
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    # The relay says at WARNING when the server cannot take its rows (at ERROR a row it refused
    # for good), the webhook view a post it refused; DEBUG shows each batch it sent.
    "loggers": {"mqclient": {"handlers": ["console"], "level": os.environ.get("SHOP_LOG_LEVEL", "WARNING")}},
}
