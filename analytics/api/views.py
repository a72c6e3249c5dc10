from drf_spectacular.utils import extend_schema
from rest_framework import exceptions
from rest_framework.response import Response

from analytics import reports
from mqsite.api import ApiView, errors
from subscribers.auth import is_operator, operator_with

from .serializers import AnalyticsQuerySerializer, AnalyticsSerializer

# What the answer shows, as the admin guards it: the last run and its statistics always, the
# trend rows when asked for.
RESULTS = ("analytics.view_analyticsrun", "analytics.view_eventstats", "analytics.view_subscriberstats")
TRENDS = ("analytics.view_eventtrend", "analytics.view_subscribertrend")


class AnalyticsView(ApiView):
    permission_classes = [operator_with(*RESULTS)]

    @extend_schema(
        summary="Operators: the last analytics run's statistics, and its hourly or daily trends",
        parameters=[AnalyticsQuerySerializer],
        responses={
            200: AnalyticsSerializer,
            **errors(
                400,
                401,
                403,
                429,
                e400="A malformed filter, or a filter without trends.",
                e403="Operators (staff) with view permission on the analytics run and statistics "
                "(and trends, when asked for) only.",
            ),
        },
    )
    def get(self, request):
        # A plain dict: "?trends=" is a 400, not the default.
        query = AnalyticsQuerySerializer(data=request.query_params.dict())
        query.is_valid(raise_exception=True)
        params = dict(query.validated_data)
        if params.get("trends") and not is_operator(request, *TRENDS):
            raise exceptions.PermissionDenied(f"Trends need the permissions {' and '.join(TRENDS)}.")
        for field in ("queue", "event"):
            if field in params:
                params[field] = self.name_or_400(params[field], field)  # names are stored lower-cased
        return Response(reports.analytics_answer(params.pop("trends", None), **params))
