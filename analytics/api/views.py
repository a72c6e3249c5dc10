from drf_spectacular.utils import extend_schema
from rest_framework.response import Response

from analytics import reports
from mqsite.api import ApiView, errors
from subscribers.auth import IsOperator

from .serializers import AnalyticsQuerySerializer, AnalyticsSerializer


class AnalyticsView(ApiView):
    permission_classes = [IsOperator]

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
                e403="Operators (staff) only.",
            ),
        },
    )
    def get(self, request):
        # A plain dict: "?trends=" is a 400, not the default.
        query = AnalyticsQuerySerializer(data=request.query_params.dict())
        query.is_valid(raise_exception=True)
        params = dict(query.validated_data)
        for field in ("queue", "event"):
            if field in params:
                params[field] = self.name_or_400(params[field], field)  # names are stored lower-cased
        return Response(reports.analytics_answer(params.pop("trends", None), **params))
