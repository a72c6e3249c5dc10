"""The socket's frames: what a client may send (checked here, before anything is done) and
what the server sends back. The consumer (delivery.consumers) only decides when; this module
says what a frame must hold and how an answer looks, in one place for every handler."""

import asyncio
import json
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from django.conf import settings
from rest_framework.utils.encoders import JSONEncoder

from delivery import publishing, subscribing
from mqsite.names import BadName, clean_name
from mqsite.parsers import (
    MAX_PUBLISH_FRAME_CONTAINERS,
    MAX_SMALL_BODY_CONTAINERS,
    BadJSON,
    TooManyContainers,
    check_containers,
    count_containers,
    decode_json,
)
from mqsite.values import storable_text
from subscribers import filters, replay

from .bounds import MAX_EXTEND_SECS, MAX_IDS, MAX_NACK_ERROR_CHARS, MAX_RETRY_IN_SECS

CLOSE_BAD_TOKEN = 4401
CLOSE_BY_OPERATOR = 4000  # an operator closed the connection (the admin)
# Daphne (autobahn) lets an application close only with 1000 or 3000-4999: the standard 1009
# (too big) and 1011 (server error) raise instead of closing, so these mirror HTTP's codes.
CLOSE_TOO_BIG = 4413
CLOSE_SERVER_ERROR = 4500
REVOKED = "its subscriber's token or right was revoked"
UNKNOWN_IDS = "These delivery ids are not yours or do not exist."
NOT_EXTENDED = "Not extended: these delivery ids are not in flight on this connection (or not yours)."
MESSAGE_FIELDS = (
    "id",
    "message_id",
    "queue",
    "event",
    "seq",
    "payload",
    "attempt",
    "published_at",
    "deliver_at",  # null when none (queues.timing)
    "expires_at",
    "group",  # null when its message names none (message groups)
)
PUBLISHED_FIELDS = ("id", "queue", "event", "seq", "deliveries")


class FrameError(Exception):
    def __init__(self, code, detail, **extra):
        super().__init__(detail)
        self.code, self.detail, self.extra = code, detail, extra

    @classmethod
    def of_limit(cls, exc):
        """A limits.LimitExceeded, as the socket tells it (with its retry_after, if any)."""
        return cls(exc.code, exc.detail, **({"retry_after": exc.wait} if exc.wait is not None else {}))

    def frame(self, ref=None):
        """The error frame: every error the socket sends is built here."""
        return {
            "type": "error",
            "code": self.code,
            "detail": self.detail,
            **self.extra,
            **({"ref": ref} if ref is not None else {}),
        }


def encode(frame):
    return json.dumps(frame, cls=JSONEncoder)


# Frames past either bound (only a publish may be) are decoded in this one thread, one at a time:
# its walk of their nesting lets the event loop run meanwhile, and several sockets' big frames
# queue here rather than contend for the loop.
BIG_FRAME_BYTES = 64 * 1024
_big_frames = ThreadPoolExecutor(max_workers=1, thread_name_prefix="big-frames")


def too_big_before_auth(raw):
    """Before `auth`, a frame is an auth frame (a token): anything bigger closes the socket
    undecoded, so that a client with no token costs no decoding."""
    return len(raw) > settings.MQ_WS_AUTH_FRAME_BYTES


def is_small(raw):
    """Within the bounds every frame may have (MAX_SMALL_BODY_CONTAINERS arrays and objects in at
    most BIG_FRAME_BYTES): decoded at once, on the event loop, by parse()."""
    return len(raw) <= BIG_FRAME_BYTES and count_containers(raw) <= MAX_SMALL_BODY_CONTAINERS


async def parse_big(raw):
    """A frame past is_small(), bounded before it is decoded by the rules of REST bodies
    (mqsite/parsers.py): only a publish may be bigger (at most MAX_PUBLISH_FRAME_CONTAINERS
    arrays and objects), decoded off the event loop; any frame nested at most
    MQ_MAX_JSON_DEPTH. Its caller awaits it only for such frames: the common, small one costs
    no coroutine (a batch publish frame of 100 messages is 24 KB)."""
    # Only a publish may be bigger: a frame that does not even name one is refused undecoded.
    publish = '"publish"' in raw if isinstance(raw, str) else b'"publish"' in raw
    if not publish and len(raw) > settings.MQ_MAX_SMALL_BODY_BYTES:  # as a REST body of its kind
        raise FrameError(
            "too_large",
            f"The frame is over the limit of {settings.MQ_MAX_SMALL_BODY_BYTES} bytes "
            "(MQ_MAX_SMALL_BODY_BYTES) for a frame other than publish.",
        )
    _check_containers(raw, MAX_PUBLISH_FRAME_CONTAINERS if publish else MAX_SMALL_BODY_CONTAINERS)
    frame = await asyncio.get_running_loop().run_in_executor(_big_frames, parse, raw)
    if frame.get("type") != "publish":
        _check_containers(raw, MAX_SMALL_BODY_CONTAINERS)
    return frame


def _check_containers(raw, limit):
    taker = "a publish frame" if limit == MAX_PUBLISH_FRAME_CONTAINERS else "a frame other than publish"
    try:
        check_containers(raw, limit, what="frame", taker=taker)
    except TooManyContainers as exc:
        raise FrameError("too_large", str(exc)) from None


def parse(raw):
    try:
        frame = decode_json(raw)
    except BadJSON as exc:
        raise FrameError("bad_json", str(exc)) from None
    if not isinstance(frame, dict):
        raise FrameError("bad_frame", "A frame is a JSON object with a 'type'.")
    return frame


def ref_of(raw):
    """The `ref` of a frame not processed (over the rate), if it is cheap to find: a frame
    within the small bounds is decoded for it, a bigger one is answered without."""
    if not is_small(raw):
        return None
    try:
        return parse(raw).get("ref")
    except FrameError:
        return None


def with_ref(frame, ref):
    return {**frame, "ref": ref} if ref is not None else frame


# --- what a client sends -------------------------------------------------------------------------


def ids_of(frame):
    ids = frame.get("ids")
    if (
        not isinstance(ids, list)
        or len(ids) > MAX_IDS
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    ):
        raise FrameError("bad_frame", "'ids' must be a list of delivery ids (whole numbers).")
    return ids


def nack_of(frame):
    """(ids, retry_in, error) of a nack frame."""
    ids = ids_of(frame)
    retry_in = frame.get("retry_in")
    if retry_in is not None and (
        isinstance(retry_in, bool)
        or not isinstance(retry_in, int | float)
        or not 0 <= retry_in <= MAX_RETRY_IN_SECS
        or not math.isfinite(retry_in)
    ):
        raise FrameError("bad_frame", f"retry_in must be a number of seconds from 0 to {MAX_RETRY_IN_SECS}.")
    error = frame.get("error")
    if error is not None and (
        not isinstance(error, str) or len(error) > MAX_NACK_ERROR_CHARS or not storable_text(error)
    ):
        raise FrameError("bad_frame", f"error must be text of at most {MAX_NACK_ERROR_CHARS} characters.")
    return ids, retry_in, error


def extend_of(frame):
    """(ids, seconds) of an extend frame."""
    ids = ids_of(frame)
    seconds = frame.get("seconds")
    if isinstance(seconds, bool) or not isinstance(seconds, int) or not 1 <= seconds <= MAX_EXTEND_SECS:
        raise FrameError("bad_frame", f"'seconds' must be a whole number from 1 to {MAX_EXTEND_SECS}.")
    return ids, seconds


def queue_name_of(frame):
    """The queue name a frame names, checked against the naming rule (not looked up)."""
    name = frame.get("queue")
    if not isinstance(name, str):
        raise FrameError("bad_frame", f"{frame.get('type')} needs a 'queue' name.")
    check_queue_name(name)
    return name


def check_queue_name(name):
    try:
        clean_name(name, "queue")
    except BadName as exc:
        raise FrameError("bad_name", str(exc)) from None


def event_of(frame):
    """The event name of a (un)subscribe frame, or None for all events."""
    event = frame.get("event")
    if event is None:
        return None
    try:
        return clean_name(event, "event")
    except BadName as exc:
        raise FrameError("bad_name", str(exc)) from None


def replay_point_of(frame):
    """The `from` of a subscribe frame (subscribers.replay.Point), or None when absent."""
    if "from" not in frame:
        return None
    try:
        return replay.point_of(frame["from"])
    except replay.BadPoint as exc:
        raise FrameError("bad_frame", f"from: {exc.detail}") from None


def filter_of(frame):
    """The `filter` of a subscribe frame, checked (subscribers.filters; null: none), or
    subscribing.KEEP when absent: the subscription keeps the one it has."""
    if "filter" not in frame:
        return subscribing.KEEP
    try:
        return filters.check_filter(frame["filter"])
    except filters.BadFilter as exc:
        raise FrameError(exc.code, str(exc)) from None


def prefetch_of(frame):
    """The `prefetch` of a subscribe frame (a whole number, at least 1), or None when absent."""
    prefetch = frame.get("prefetch")
    if prefetch is None:
        return None
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
        raise FrameError("bad_frame", "prefetch must be a whole number, at least 1.")
    return prefetch


def outgoing_of(frame):
    """The messages of a publish frame, prepared: one for a single frame, each item of
    `messages` for a batch frame (up to publishing.MAX_BATCH, all or nothing: the first bad
    item refuses the frame, naming its index). Returns (outgoing list, whether a batch)."""
    if "messages" not in frame:
        return [_prepare(frame)], False
    items = frame["messages"]
    if not isinstance(items, list) or not items or len(items) > publishing.MAX_BATCH:
        raise FrameError("bad_frame", f"'messages' must be a list of 1 to {publishing.MAX_BATCH} messages.")
    outgoing = []
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            raise FrameError(
                "bad_message", f"messages[{index}]: a message is an object with an 'event'.", index=index
            )
        try:
            outgoing.append(_prepare(item))
        except FrameError as exc:
            raise FrameError(exc.code, f"messages[{index}]: {exc.detail}", index=index) from None
    return outgoing, True


def receipt_of(frame, outgoing):
    """A publish frame's `receipt` (false when absent): each of its messages marked when true."""
    receipt = frame.get("receipt", False)
    if not isinstance(receipt, bool):
        raise FrameError("bad_frame", "receipt must be true or false.")
    return [replace(o, receipt=True) for o in outgoing] if receipt else outgoing


def _prepare(item):
    if "payload" not in item:
        raise FrameError("bad_frame", "publish needs a 'payload' (null is a payload).")
    try:
        return publishing.prepare(
            item.get("event"),
            item["payload"],
            item.get("key"),
            item.get("headers"),
            item.get("group"),
            **publishing.timing_fields(item),
        )
    except publishing.PayloadTooLarge as exc:
        raise FrameError("too_large", str(exc)) from None
    except publishing.BadMessageTiming as exc:
        raise FrameError(exc.code, str(exc)) from None
    except publishing.BadMessageHeaders as exc:
        raise FrameError("bad_message", f"headers: {exc}") from None
    except publishing.BadMessage as exc:
        raise FrameError("bad_message", str(exc)) from None


# --- what the server sends -----------------------------------------------------------------------


def message_frame(delivery):
    """A `message` frame (also each item of a `messages` frame, and a webhook's body), with
    `headers` only when its message has some."""
    frame = {"type": "message", **{k: delivery[k] for k in MESSAGE_FIELDS}}
    if "headers" in delivery:
        frame["headers"] = delivery["headers"]
    return frame


# message_frame() as PostgreSQL writes it, from the stored texts: the payload and headers go in
# as they were stored (compact JSON, checked at publish) rather than decoded and encoded again,
# which was most of the Python a socket spent per delivery (64 µs against 15 µs, issue 28).
# The same fields in the same order as message_frame(); `published_at` as the API's encoder
# writes a UTC time (ISO 8601, microseconds only when there are some, "Z").
# tests/delivery/test_frames.py holds the two to the same JSON.
def message_text(delivery):
    """A leased delivery's `message` frame as text: the one PostgreSQL wrote (`frame`, a
    framed lease) or encoded here."""
    text = delivery.get("frame")
    return text if text is not None else encode(message_frame(delivery))


def messages_text(texts):
    """A `messages` frame of these `message` frame texts."""
    return '{"type":"messages","messages":[' + ",".join(texts) + "]}"


def published_frame(answers, batch, ref):
    """The `published` answer of a publish frame: its one message, or every message of a
    batch frame in the given order."""
    if batch:
        frame = {
            "type": "published",
            "messages": [{k: a[k] for k in ("id", "seq", "deliveries")} for a in answers],
        }
    else:
        frame = {"type": "published", **{k: answers[0][k] for k in PUBLISHED_FIELDS}}
    return with_ref(frame, ref)
