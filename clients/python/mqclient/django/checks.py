"""Django system checks of the MQ setting (`manage.py check`, and before runserver, migrate and
every management command): a project that routes the webhook view without a secret, or names a
secret that is not one, is told at start-up rather than by a failed post in production."""

from __future__ import annotations

from typing import Any

from django.core.checks import Error, Tags, Warning, register
from standardwebhooks import Webhook

from . import conf


def _routes(patterns: Any, views: tuple) -> bool:
    """Whether one of `views` is the callback of any pattern, included URLconfs too."""
    for pattern in patterns:
        if hasattr(pattern, "url_patterns"):  # an include()
            if _routes(pattern.url_patterns, views):
                return True
        elif getattr(pattern, "callback", None) in views:
            return True
    return False


def _webhook_view_routed() -> bool:
    from django.urls import get_resolver

    from . import webhook_view as package_view  # what the docs route
    from .webhooks import webhook_view

    try:
        return _routes(get_resolver().url_patterns, (package_view, webhook_view))
    except Exception:  # noqa: BLE001 - a broken URLconf is Django's own check's to report
        return False


@register(Tags.urls)
def check_webhook_secret(app_configs: Any = None, **kwargs: Any) -> list:
    secret = conf.get("WEBHOOK_SECRET")
    if not secret:
        if _webhook_view_routed():
            return [
                Error(
                    'mqclient.django.webhook_view is routed but settings.MQ["WEBHOOK_SECRET"] is not set: '
                    "every post would be refused.",
                    hint="Set it to the whsec_... secret that createsubscriber --webhook printed for the "
                    "subscriber whose deliveries this project receives.",
                    id="mqclient.E001",
                )
            ]
        return []
    try:
        Webhook(secret)
    except Exception as exc:  # noqa: BLE001 - binascii.Error, EmptyWebhookSecretError, TypeError
        return [
            Error(
                f'settings.MQ["WEBHOOK_SECRET"] is not a webhook secret ({exc}).',
                hint='It is "whsec_" followed by base64, as createsubscriber --webhook printed it.',
                id="mqclient.E002",
            )
        ]
    return []


@register()
def check_server(app_configs: Any = None, **kwargs: Any) -> list:
    url = conf.get("URL")
    if url and not str(url).startswith(("http://", "https://")):
        return [
            Error(
                f'settings.MQ["URL"] must be the server\'s http:// or https:// address, not {url!r}.',
                id="mqclient.E003",
            )
        ]
    missing = [name for name in ("URL", "TOKEN") if not conf.get(name)]
    if missing:
        names = " and ".join(f'settings.MQ["{name}"]' for name in missing)
        return [
            Warning(
                f"{names} not set: publish() keeps its rows in the outbox and nothing is sent.",
                hint="Set the server's address and the token createsubscriber printed (a test "
                "settings module may leave them out on purpose).",
                id="mqclient.W001",
            )
        ]
    return []
