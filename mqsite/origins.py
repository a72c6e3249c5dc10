from channels.security.websocket import OriginValidator
from django.conf import settings


class ServiceOrAllowedHostsOriginValidator(OriginValidator):
    """Refuse a websocket handshake whose Origin names a host outside ALLOWED_HOSTS (a page on
    another site driving a logged-in browser). A client that sends no Origin is a service,
    not a browser, and authenticates by token: it is let in."""

    def __init__(self, application):
        super().__init__(application, allowed_origins=list(settings.ALLOWED_HOSTS))

    def valid_origin(self, parsed_origin):
        return parsed_origin is None or self.validate_origin(parsed_origin)
