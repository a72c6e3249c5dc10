"""The contract's answers, field by field, as the tests assert them whole (README, "The
protocol"): a test that finds one more or one less field than these fails, so that no field
leaks out (a subscriber, a lease holder) and none goes missing."""

# What every delivery carries of its message's timing (null when none): a delayed message's
# deliver_at, an expiring one's expires_at; and its group ("group": null when it names none).
TIMING_FIELDS = frozenset({"deliver_at", "expires_at"})

# A delivery as GET /api/deliveries and `manage.py listen` hand it out.
DELIVERY_FIELDS = (
    frozenset(
        {
            "id",
            "message_id",
            "queue",
            "event",
            "seq",
            "payload",
            "attempt",
            "published_at",
            "ack_deadline",
            "group",
        }
    )
    | TIMING_FIELDS
)

# A `message` frame of the socket (it has no ack deadline: the socket's lease is its own).
MESSAGE_FRAME_FIELDS = (
    frozenset(
        {"type", "id", "message_id", "queue", "event", "seq", "payload", "attempt", "published_at", "group"}
    )
    | TIMING_FIELDS
)

# A message as its publish answers it (REST and `manage.py publish --json`).
PUBLISHED_FIELDS = frozenset({"id", "queue", "event", "seq", "deliveries", "created_at"})
