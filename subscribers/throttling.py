import functools
import logging

from django.conf import settings
from django.core.cache import caches
from django.core.cache.backends.redis import RedisCache
from rest_framework.throttling import SimpleRateThrottle

from mqsite.client_address import request_client_address
from mqsite.rates import parse_rate

log = logging.getLogger(__name__)


@functools.cache
def counters():
    """One cache client for the whole process. `django.core.cache.cache` is per thread, and
    under ASGI every request runs in a thread of its own, so each request built a RedisCache
    with a pool of its own and opened a new TCP connection to Redis just to count itself (a
    seventh of the CPU of a publish, bench/PROFILE.md). redis-py's pool is thread-safe, and
    LocMemCache instances of one name share their storage, so sharing one is safe for both."""
    return caches.create_connection("default")


def count_request(cache, key, timeout):
    """Add one to the counter `key` (made with a lifetime of `timeout` seconds); its new value.

    On Redis, one round trip: INCR makes a missing key at 1, and EXPIRE NX (Redis 7) gives it
    its lifetime only when it has none. Django's add() and incr() took three (SET NX, then
    EXISTS and INCR), a fifth of a single publish's CPU in Daphne (bench/PROFILE.md)."""
    if isinstance(cache, RedisCache):
        key = cache.make_and_validate_key(key)
        pipe = _writer(cache).pipeline(transaction=False)
        pipe.incr(key)
        pipe.expire(key, timeout, nx=True)
        return pipe.execute()[0]
    cache.add(key, 0, timeout=timeout)
    try:
        return cache.incr(key)
    except ValueError:  # the window expired between add and incr
        cache.set(key, 1, timeout=timeout)
        return 1


@functools.cache
def _writer(cache):
    """The Redis client that writes `cache`'s keys. Django makes a client object for each call
    (get_client: the same connection pool, a new redis.Redis and its tables), a twentieth of a
    request's CPU in the throttle; one, thread-safe as its pool is, serves every request."""
    return cache._cache.get_client(write=True)


class ClientRateThrottle(SimpleRateThrottle):
    """Requests per subscriber (or operator, or address when anonymous), in fixed windows.

    DRF's own throttles keep a list of every request time in the cache, which costs O(rate)
    per request; at the thousands of requests a second a queue serves, a counter per window
    (one atomic increment) does the same job.
    """

    scope = "client"

    def get_rate(self):
        return settings.MQ_THROTTLE_RATE  # read per request, so a test can override it

    def parse_rate(self, rate):
        # Also "N/Ks" (a rate with a burst), which DRF's own parse cannot read.
        return (None, None) if rate is None else parse_rate(rate)

    def get_cache_key(self, request, view):
        user = request.user
        ident = user.pk if user is not None and user.is_authenticated else self.get_ident(request)
        return f"throttle:{self.scope}:{ident}"

    def get_ident(self, request):
        # Not DRF's: without NUM_PROXIES it reads the client's own X-Forwarded-For.
        return request_client_address(request)

    def allow_request(self, request, view):
        self.rate = self.get_rate()
        self.num_requests, self.duration = self.parse_rate(self.rate)
        if self.rate is None:
            return True
        key = self.get_cache_key(request, view)
        if key is None:
            return True
        self.now = self.timer()
        window = int(self.now // self.duration)
        window_key = f"{key}:{window}"
        try:
            count = count_request(counters(), window_key, self.duration + 1)
        except Exception:
            # The cache (Redis) is down: let the request through. Refusing every publish
            # because the rate counter is unreachable would turn a cache outage into an outage.
            log.warning("throttle cache unavailable; not throttling", exc_info=True)
            return True
        self.window_end = (window + 1) * self.duration
        return count <= self.num_requests

    def wait(self):
        return max(self.window_end - self.now, 0)
