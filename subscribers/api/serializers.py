from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from mqsite.api import NameField
from subscribers import filters, replay


@extend_schema_field(replay.FROM_SCHEMA)
class ReplayPointField(serializers.Field):
    """`from` of a subscribe: where a new subscription starts (subscribers.replay)."""

    def to_internal_value(self, data):
        try:
            return replay.point_of(data)
        except replay.BadPoint as exc:
            raise serializers.ValidationError(exc.detail) from None

    def to_representation(self, value):
        return value


@extend_schema_field(replay.REPLAY_SCHEMA)
class ReplayField(serializers.Field):
    """The `replay` of an answer: {"from_seq", "deliveries"} (for the schema; views give dicts)."""

    def to_representation(self, value):
        return value


@extend_schema_field(filters.FILTER_SCHEMA)
class FilterField(serializers.JSONField):
    """A subscription's `filter`, as sent: subscribers.filters checks it (400 bad_filter)."""


class SubscribeSerializer(serializers.Serializer):
    queue = NameField()
    event = NameField(required=False, allow_null=True, help_text="Absent or null: every event of the queue.")
    filter = FilterField(
        required=False,
        allow_null=True,
        help_text="Only messages whose values match (subscribers.filters); null: all. Absent: a new "
        "subscription has none, an existing one keeps its own.",
    )

    def get_fields(self):
        # "from" is a Python keyword: it cannot be declared as an attribute.
        return {**super().get_fields(), "from": ReplayPointField(required=False)}


class SubscriptionSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    queue = serializers.CharField()
    event = serializers.CharField(allow_null=True)
    created_at = serializers.DateTimeField()
    paused = serializers.BooleanField(
        help_text="Paused (POST .../pause): still owed what is published, handed nothing until resumed."
    )
    filter = FilterField(allow_null=True, help_text="Only messages that match it are owed; null: all.")


class SubscriptionChangeSerializer(serializers.Serializer):
    filter = FilterField(
        required=False, allow_null=True, help_text="The new filter; null: none (every message is owed)."
    )


class SubscribedSerializer(SubscriptionSerializer):
    replay = ReplayField(
        required=False,
        help_text='Only when the request had "from": where the replay started and what it made owed.',
    )


class SeekResultSerializer(SubscriptionSerializer):
    replay = ReplayField()


class SubscriptionListSerializer(serializers.Serializer):
    subscriptions = SubscriptionSerializer(many=True)


def subscription_answer(subscription):
    return {
        "id": subscription.pk,
        "queue": subscription.queue.name,
        "event": subscription.event.name if subscription.event_id else None,
        "created_at": subscription.created_at,
        "paused": subscription.paused,
        "filter": subscription.filter,
    }


class ConnectionSubscriptionSerializer(serializers.Serializer):
    queue = serializers.CharField()
    event = serializers.CharField(allow_null=True)


class ConnectionSerializer(serializers.Serializer):
    subscriber = serializers.CharField()
    connected_at = serializers.DateTimeField()
    last_seen = serializers.DateTimeField()
    remote_addr = serializers.CharField()
    subscriptions = ConnectionSubscriptionSerializer(many=True)


class ConnectionListSerializer(serializers.Serializer):
    connections = ConnectionSerializer(many=True)
