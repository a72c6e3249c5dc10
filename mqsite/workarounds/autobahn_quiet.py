"""Autobahn (Daphne's websocket protocol) colours the arguments of a debug log line on every
frame it sends and every read, with click.style, before the logger decides the line is not
wanted: about 5 % of Daphne's CPU while a socket streams deliveries (py-spy, bench/PROFILE.md
section 8). The same arguments, uncoloured, cost a string format.

Its test: tests/mqsite/test_workarounds_autobahn.py. It can go when autobahn formats a log line's
arguments only once the logger has decided to write it (its hltype and hlval calls are eager).
"""

from autobahn.twisted import websocket as twisted_websocket
from autobahn.websocket import protocol


def _type(obj):
    return f"<{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}>"


def _value(value, color=None, bold=None):
    return f"{value}"


def install():
    for module in (protocol, twisted_websocket):
        module.hltype = _type
        module.hlval = _value
