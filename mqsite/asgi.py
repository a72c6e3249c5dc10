"""ASGI entry point, served by Daphne: HTTP, and websockets at /ws/."""

import os
import sys

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mqsite.settings")

from mqsite import db_budget  # noqa: E402

if "twisted.internet.reactor" in sys.modules:  # served by Daphne: a web process's pool size
    db_budget.size_web_pool()

import django  # noqa: E402

django.setup(set_prefix=False)  # as get_asgi_application() does, before the consumers are imported

from mqsite import tracing  # noqa: E402

tracing.start("web")  # OTEL_*: before the handler loads the middleware (mqsite.tracing)

from mqsite.asgi_handler import SyncChainASGIHandler  # noqa: E402

django_http = SyncChainASGIHandler()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import WebsocketDenier  # noqa: E402
from django.urls import path, re_path  # noqa: E402

from dashboard.consumers import DashboardConsumer  # noqa: E402
from delivery import stopping  # noqa: E402
from delivery.consumers import DeliveryConsumer  # noqa: E402
from mqsite import bus, heap  # noqa: E402
from mqsite.origins import ServiceOrAllowedHostsOriginValidator  # noqa: E402
from mqsite.workarounds import daphne_shutdown  # noqa: E402

application = ProtocolTypeRouter(
    {
        "http": daphne_shutdown.CountHTTPRequests(django_http, stopping.stopping),
        "websocket": URLRouter(
            [
                # Token-authenticated only (never a cookie): `Origin: null` is let in too.
                path(
                    "ws/",
                    ServiceOrAllowedHostsOriginValidator(DeliveryConsumer.as_asgi(), null_origin_ok=True),
                ),
                # The operators' dashboard: the admin login's session, staff only.
                path(
                    "ws/dashboard/",
                    ServiceOrAllowedHostsOriginValidator(AuthMiddlewareStack(DashboardConsumer.as_asgi())),
                ),
                # Any other path: a refused handshake (403), not URLRouter's "No route found"
                # error and its traceback in the server's log.
                re_path(r"", WebsocketDenier.as_asgi()),
            ]
        ),
    }
)

# Served by Daphne (its Twisted reactor is running this): on SIGTERM, requests under way
# finish, websockets hand back what they hold (delivery/stopping.py), and the process exits
# (mqsite/workarounds/daphne_shutdown.py).
if "twisted.internet.reactor" in sys.modules:
    from twisted.internet import reactor

    from delivery import liveness, observe
    from mqsite import prometheus
    from mqsite.workarounds import autobahn_quiet, daphne_bodies, daphne_headers

    daphne_shutdown.install(reactor, stopping.stop, stopping.drain, stopping.describe)
    autobahn_quiet.install()
    daphne_bodies.install()  # a body over its route's limit: 413 before it is read
    daphne_headers.install()  # a request's headers within MQ_HTTP_HEADER_TIMEOUT_SECS, in all
    # What this process holds is handed back within seconds if it is killed (delivery.liveness).
    # Once the reactor runs: a test process that merely imported Daphne never beats.
    reactor.callWhenRunning(liveness.start, "web")
    prometheus.register_process("web")  # its process_* on /metrics (mqsite.prometheus)
    reactor.addSystemEventTrigger("during", "shutdown", prometheus.exiting)  # before the os._exit
    observe.start_serving()
    # A publish's answer waits for no Redis round trip or webhook query (mqsite.bus).
    bus.send_from_a_thread()
    # The other processes' wake-ups and announcements, heard from the start (not from the
    # first socket): a process that serves only REST keeps rows that a change in another
    # process must make it forget (delivery.revocation). Scheduled on the loop once it runs.
    reactor.callWhenRunning(reactor.callLater, 0, bus.ensure_listening)
    # Started: what start-up made is frozen, out of the collector's walks (mqsite.heap).
    reactor.callWhenRunning(heap.freeze, web=True)
