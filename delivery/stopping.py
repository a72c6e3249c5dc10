"""What a web process of this app does as Daphne stops (mqsite/workarounds/daphne_shutdown.py
calls these, as mqsite/asgi.py installs it): long polls stop waiting and new requests are
answered 503, then every websocket hands back what it holds."""

from . import liveness, socket_loops, wakeups

stopping = wakeups.stopping


def stop():
    wakeups.stop_waiting()


async def drain():
    await socket_loops.release_open_sockets()
    # A clean stop, not a death: what pulls took stays theirs until their ack deadline.
    await socket_loops.db(liveness.stop)()


def describe():
    return f"{socket_loops.open_sockets()} websockets open"
