from rest_framework import serializers

from delivery.bounds import (
    MAX_EXTEND_SECS,
    MAX_IDS,
    MAX_LEASE,
    MAX_NACK_ERROR_CHARS,
    MAX_RETRY_IN_SECS,
    MAX_WAIT_SECS,
)
from mqsite.api import (
    BoundedListField,
    NameField,
    StorableCharField,
    StrictFloatField,
    StrictIntegerField,
)


class LeaseQuerySerializer(serializers.Serializer):
    # Empty ("?queue=") is no filter, as if absent.
    queue = NameField(required=False, allow_blank=True)
    event = NameField(required=False, allow_blank=True)
    limit = serializers.IntegerField(required=False, default=100, min_value=1, max_value=MAX_LEASE)
    wait = serializers.FloatField(
        required=False,
        default=0,
        min_value=0,
        max_value=MAX_WAIT_SECS,
        help_text="Seconds to wait for a delivery when none is ready (long-poll).",
    )


class DeliverySerializer(serializers.Serializer):
    id = serializers.IntegerField()
    message_id = serializers.IntegerField()
    queue = serializers.CharField()
    event = serializers.CharField()
    seq = serializers.IntegerField()
    payload = serializers.JSONField(allow_null=True)
    attempt = serializers.IntegerField()
    published_at = serializers.DateTimeField()
    ack_deadline = serializers.DateTimeField()
    group = serializers.CharField(
        allow_null=True, help_text="Its message's group (message groups); null when it names none."
    )
    deliver_at = serializers.DateTimeField(
        allow_null=True, help_text="A delayed message's time: not handed out before it. Null when none."
    )
    expires_at = serializers.DateTimeField(
        allow_null=True,
        help_text="Not acked by then, it goes no further (dead, reason expired). Null when none.",
    )
    headers = serializers.DictField(
        child=serializers.CharField(),
        required=False,
        help_text="The message's headers, only when it was published with some.",
    )


class DeliveryListSerializer(serializers.Serializer):
    deliveries = DeliverySerializer(many=True)


class AckSerializer(serializers.Serializer):
    ids = BoundedListField(child=StrictIntegerField(), max_length=MAX_IDS)


class AckResultSerializer(serializers.Serializer):
    acked = serializers.IntegerField(help_text="How many were newly acknowledged.")
    unknown = serializers.ListField(child=serializers.IntegerField())


class ExtendSerializer(serializers.Serializer):
    ids = BoundedListField(child=StrictIntegerField(), max_length=MAX_IDS)
    seconds = StrictIntegerField(
        min_value=1,
        max_value=MAX_EXTEND_SECS,
        help_text="The new ack deadline of each, in seconds from now (it may also shorten a lease).",
    )


class ExtendResultSerializer(serializers.Serializer):
    extended = serializers.IntegerField(help_text="How many leases were extended.")
    unknown = serializers.ListField(
        child=serializers.IntegerField(),
        help_text="Ids that are not the caller's in-flight deliveries (another's, not in flight, or none).",
    )


class NackSerializer(serializers.Serializer):
    retry_in = StrictFloatField(required=False, allow_null=True, min_value=0, max_value=MAX_RETRY_IN_SECS)
    # An extension of the contract: why the client gives it back, kept as the delivery's last
    # error, so that an operator reading a dead letter sees the client's reason.
    error = StorableCharField(
        required=False,
        allow_blank=True,
        max_length=MAX_NACK_ERROR_CHARS,
        trim_whitespace=False,
    )


class NackResultSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    status = serializers.CharField()
    attempt = serializers.IntegerField()
    next_attempt_at = serializers.DateTimeField()


class DeliveryCountsSerializer(serializers.Serializer):
    pending = serializers.IntegerField()
    inflight = serializers.IntegerField()
    acked = serializers.IntegerField()
    dead = serializers.IntegerField()


class ReceiptSubscriptionSerializer(serializers.Serializer):
    subscriber = serializers.CharField()
    event = serializers.CharField(
        allow_null=True, help_text="The subscription's event; null: every event of the queue (or it is gone)."
    )
    status = serializers.ChoiceField(choices=["pending", "inflight", "acked", "dead"])
    attempt = serializers.IntegerField()
    acked_at = serializers.DateTimeField(allow_null=True)


class ReceiptSerializer(serializers.Serializer):
    """A message with how far its deliveries got (for the schema; the view returns a dict)."""

    id = serializers.IntegerField()
    queue = serializers.CharField()
    event = serializers.CharField()
    seq = serializers.IntegerField()
    created_at = serializers.DateTimeField()
    deliveries = DeliveryCountsSerializer(help_text="How many of its deliveries are in each state.")
    subscriptions = ReceiptSubscriptionSerializer(
        many=True,
        required=False,
        help_text="Operators only: each subscription it was owed to, the first 1000 by delivery id "
        "(the counts cover all of them).",
    )
