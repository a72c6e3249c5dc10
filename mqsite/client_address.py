"""The client's address: the one rule every throttle and the admin's login lockout count by.

It is the connection's peer (REMOTE_ADDR; a socket's scope["client"]). Only when that peer is
one of MQ_TRUSTED_PROXIES is X-Forwarded-For believed, read from its right end (what the
proxies nearest to this server added), past every trusted proxy, to the first address that is
not one: the client as the outermost trusted proxy saw it. A client's own X-Forwarded-For is
never believed: DRF's throttle read it, so a scanner escaped the anonymous throttle by naming
a new address each time.
"""

import functools
import ipaddress

from django.conf import settings


@functools.cache
def _networks(trusted):
    return tuple(ipaddress.ip_network(t, strict=False) for t in trusted)


def _is_trusted(address, networks):
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in net for net in networks)


def client_address(peer, forwarded_for=""):
    """The client's address, from the connection's peer and its X-Forwarded-For header."""
    peer = peer or ""
    networks = _networks(tuple(settings.MQ_TRUSTED_PROXIES))
    if not forwarded_for or not networks or not _is_trusted(peer, networks):
        return peer
    client = peer
    for hop in reversed(forwarded_for.split(",")):
        hop = hop.strip()
        try:
            ipaddress.ip_address(hop)
        except ValueError:
            break  # not an address (a proxy's "unknown"): the last trusted hop is what we know
        client = hop
        if not _is_trusted(hop, networks):
            break
    return client


def request_client_address(request):
    """The client's address of an HTTP request (Django's or DRF's). Also axes' client IP
    (settings.AXES_CLIENT_IP_CALLABLE), so that its login lockout counts the same clients."""
    meta = request.META
    return client_address(meta.get("REMOTE_ADDR"), meta.get("HTTP_X_FORWARDED_FOR", ""))


def scope_client_address(scope):
    """The client's address of an ASGI connection (a websocket)."""
    peer = (scope.get("client") or ("", 0))[0]
    forwarded = b",".join(v for k, v in scope.get("headers", ()) if k == b"x-forwarded-for")
    return client_address(peer, forwarded.decode("latin-1"))
