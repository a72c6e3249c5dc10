"""The API's OpenAPI schema, built once per process.

drf-spectacular's view builds it again at every call (every view and serializer inspected:
~0.12 s of CPU), so anyone could make the server spend that in a loop, without a token. The
schema depends on the code only (not on the caller, nor on settings), so the first call's is
kept. The API has one version and one language: ?version= and ?lang=, which would build (and
keep) another schema for any value sent, are ignored.
"""

import logging
import threading

from django.http import HttpResponse
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.utils import extend_schema
from drf_spectacular.views import SCHEMA_KWARGS, SpectacularAPIView

log = logging.getLogger(__name__)

_lock = threading.Lock()
_built = None
# The rendered bytes by renderer and media type: rendering the kept schema again took
# 0.13-0.15 s a call (YAML most), as much as building it.
_rendered = {}


def api_schema(request):
    """The schema, built by the first call of this process."""
    global _built
    if _built is None:
        with _lock:  # two first calls at once build it once
            if _built is None:
                generator = SpectacularAPIView.generator_class(urlconf=None, api_version=None)
                _built = generator.get_schema(request=request, public=True)
                log.info("built the API schema (served from memory from now on)")
    return _built


class BearerTokenScheme(OpenApiAuthenticationExtension):
    """The token in the OpenAPI schema (drf-spectacular finds it by the class it names). Here,
    beside the schema's view, not beside the class: drf-spectacular's import costs a third of a
    second, which every process that authenticates (and `manage.py analyze`, through the
    apps' ready()) would pay for a schema it never builds."""

    target_class = "subscribers.auth.BearerTokenAuthentication"
    name = "bearerAuth"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "description": "A subscriber's API token."}


class SchemaView(SpectacularAPIView):
    @extend_schema(**SCHEMA_KWARGS)  # as the view it replaces: left out of the schema it serves
    def get(self, request, *args, **kwargs):
        renderer, media_type = request.accepted_renderer, request.accepted_media_type
        key = (type(renderer), media_type)
        if key not in _rendered:
            context = self.get_renderer_context()
            _rendered[key] = renderer.render(api_schema(request), media_type, context)
        response = HttpResponse(_rendered[key], content_type=f"{media_type}; charset=utf-8")
        response["Content-Disposition"] = f'inline; filename="{self._get_filename(request, None)}"'
        return response
