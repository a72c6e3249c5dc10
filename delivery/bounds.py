"""The bounds of what a client may ask of deliveries, in one place for both transports: the REST
serializers (delivery.api.serializers) and the websocket frames (delivery.frames) check the same
numbers, and the ledger the one it enforces itself. (Publishing's are delivery.publishing's and
queues.headers', shared the same way; the sizes of bodies and frames are mqsite.parsers'.)"""

# Deliveries one lease may hand out (REST `limit`).
MAX_LEASE = 1000
# The longest a REST long poll waits (`wait`).
MAX_WAIT_SECS = 30
# Delivery ids one ack, nack or extension may name.
MAX_IDS = 10_000
# The longest a nack may put its retry off (`retry_in`): a week.
MAX_RETRY_IN_SECS = 7 * 24 * 3600
# The words a nack may give (`error`), kept as the delivery's last error.
MAX_NACK_ERROR_CHARS = 1000
# The longest a client may push its ack deadline out in one call (API.md, Extensions): SQS's
# limit on a visibility timeout. A worker that needs longer extends again; one that died holds
# its deliveries no longer than this.
MAX_EXTEND_SECS = 12 * 3600
