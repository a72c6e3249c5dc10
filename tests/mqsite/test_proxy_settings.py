"""The settings a deployment behind a proxy sets (docs/deploy.md): a malformed value stops the
start with a message naming it, rather than serving with a setting that does not hold."""

import re
import runpy

import pytest
from django.core.exceptions import ImproperlyConfigured

from tests.support.servers import ROOT


def settings_with(monkeypatch, **env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return runpy.run_path(str(ROOT / "mqsite" / "settings.py"))


def test_a_deployment_names_its_origins_address_and_static_root(monkeypatch, tmp_path):
    s = settings_with(
        monkeypatch,
        CSRF_TRUSTED_ORIGINS="https://mq.example.com:8443,https://*.example.org",
        MQ_BIND_ADDRESS="10.0.0.5",
        STATIC_ROOT=str(tmp_path / "static"),
    )
    assert s["CSRF_TRUSTED_ORIGINS"] == ["https://mq.example.com:8443", "https://*.example.org"]
    assert s["MQ_BIND_ADDRESS"] == "10.0.0.5"
    assert s["STATIC_ROOT"] == tmp_path / "static" and (tmp_path / "static").is_dir()
    assert settings_with(monkeypatch, MQ_BIND_ADDRESS="127.0.0.1")["MQ_BIND_ADDRESS"] == "127.0.0.1"


@pytest.mark.parametrize(
    ("name", "value", "words"),
    [
        ("CSRF_TRUSTED_ORIGINS", "mq.example.com", "CSRF_TRUSTED_ORIGINS holds 'mq.example.com'"),
        ("CSRF_TRUSTED_ORIGINS", "https://mq.example.com/admin", "scheme://host"),
        ("MQ_BIND_ADDRESS", "localhost", "MQ_BIND_ADDRESS must be an IPv4 address"),
        ("MQ_BIND_ADDRESS", "::1", "MQ_BIND_ADDRESS must be an IPv4 address"),
    ],
)
def test_a_malformed_value_stops_the_start_naming_it(monkeypatch, name, value, words):
    with pytest.raises(ImproperlyConfigured, match=re.escape(words)):
        settings_with(monkeypatch, **{name: value})
