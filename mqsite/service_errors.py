"""The error type of the services: a refusal that carries its HTTP status and code, so that the
API answers it (mqsite.api.ApiView) without importing the service that raised it, which sits in
a layer above the API's base class."""


class ServiceError(Exception):
    """A service refused: `status_code` and `code` are what the REST API answers, detail() its
    words. Subclasses set the three; str() stays the service's own (callers read it)."""

    status_code = 400
    code = "invalid"

    def detail(self):
        return str(self)
