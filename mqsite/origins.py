from channels.security.websocket import OriginValidator
from django.conf import settings


class ServiceOrAllowedHostsOriginValidator(OriginValidator):
    """Refuse a websocket handshake whose Origin names a host outside ALLOWED_HOSTS (a page on
    another site driving a logged-in browser). A client that sends no Origin is a service,
    not a browser, and authenticates by token: it is let in.

    `null_origin_ok` lets in `Origin: null` too, which names no host: a browser sends it from a
    file:// page, about:blank, a data: URL or a sandboxed iframe. Only for a route that never
    authenticates by cookie (/ws/: a token in the URL, a header or the `auth` frame): the Origin
    check exists against cross-site websocket hijacking, a foreign page riding the browser's
    session cookie, and a page that must bring a token of its own gains nothing by it. A
    cookie-authenticated route (/ws/dashboard/) keeps refusing it, since any site can make a
    browser send `null` (a sandboxed iframe) with the operator's cookies. Foreign named hosts
    stay refused on every route, as API.md says."""

    def __init__(self, application, *, null_origin_ok=False):
        super().__init__(application, allowed_origins=list(settings.ALLOWED_HOSTS))
        self.null_origin_ok = null_origin_ok

    def valid_origin(self, parsed_origin):
        if parsed_origin is None:
            return True
        if self.null_origin_ok and is_null(parsed_origin):
            return True
        return self.validate_origin(parsed_origin)


def is_null(parsed_origin):
    """An opaque origin, serialised as `null` (RFC 6454, 7.3)."""
    return parsed_origin.geturl().strip().lower() == "null"
