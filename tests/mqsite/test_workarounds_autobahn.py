"""Autobahn's log arguments, uncoloured (mqsite/workarounds/autobahn_quiet.py): once installed,
the helpers autobahn calls on every frame return plain text, with no terminal escape codes."""

from autobahn.twisted import websocket as twisted_websocket
from autobahn.websocket import protocol

from mqsite.workarounds import autobahn_quiet


def test_log_arguments_are_plain_text_once_installed(monkeypatch):
    for module in (protocol, twisted_websocket):
        monkeypatch.setattr(module, "hltype", module.hltype)
        monkeypatch.setattr(module, "hlval", module.hlval)
    autobahn_quiet.install()
    for module in (protocol, twisted_websocket):
        assert module.hlval(42) == "42"
        assert module.hlval("frame", color="yellow", bold=True) == "frame"
        assert module.hltype(protocol.WebSocketProtocol) == "<autobahn.websocket.protocol.WebSocketProtocol>"
        assert "\x1b" not in module.hltype(protocol.WebSocketProtocol) + module.hlval("x", color="red")
