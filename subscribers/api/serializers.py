from rest_framework import serializers

from mqsite.api import NameField


class SubscribeSerializer(serializers.Serializer):
    queue = NameField()
    event = NameField(required=False, allow_null=True, help_text="Absent or null: every event of the queue.")


class SubscriptionSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    queue = serializers.CharField()
    event = serializers.CharField(allow_null=True)
    created_at = serializers.DateTimeField()


class SubscriptionListSerializer(serializers.Serializer):
    subscriptions = SubscriptionSerializer(many=True)


def subscription_answer(subscription):
    return {
        "id": subscription.pk,
        "queue": subscription.queue.name,
        "event": subscription.event.name if subscription.event_id else None,
        "created_at": subscription.created_at,
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
