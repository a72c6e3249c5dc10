import functools
import logging

from django.conf import settings
from django.core.cache import caches
from rest_framework.throttling import SimpleRateThrottle

log = logging.getLogger(__name__)


@functools.cache
def counters():
    """One cache client for the whole process. `django.core.cache.cache` is per thread, and
    under ASGI every request runs in a thread of its own, so each request built a RedisCache
    with a pool of its own and opened a new TCP connection to Redis just to count itself (a
    seventh of the CPU of a publish, bench/PROFILE.md). redis-py's pool is thread-safe, and
    LocMemCache instances of one name share their storage, so sharing one is safe for both."""
    return caches.create_connection("default")


class ClientRateThrottle(SimpleRateThrottle):
    """Requests per subscriber (or operator, or address when anonymous), in fixed windows.

    DRF's own throttles keep a list of every request time in the cache, which costs O(rate)
    per request; at the thousands of requests a second a queue serves, a counter per window
    (one atomic increment) does the same job.
    """

    scope = "client"

    def get_rate(self):
        return settings.MQ_THROTTLE_RATE  # read per request, so a test can override it

    def get_cache_key(self, request, view):
        user = request.user
        ident = user.pk if user is not None and user.is_authenticated else self.get_ident(request)
        return f"throttle:{self.scope}:{ident}"

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
        cache = counters()
        try:
            cache.add(window_key, 0, timeout=self.duration + 1)
            try:
                count = cache.incr(window_key)
            except ValueError:  # the window expired between add and incr
                cache.set(window_key, 1, timeout=self.duration + 1)
                count = 1
        except Exception:
            # The cache (Redis) is down: let the request through. Refusing every publish
            # because the rate counter is unreachable would turn a cache outage into an outage.
            log.warning("throttle cache unavailable; not throttling", exc_info=True)
            return True
        self.window_end = (window + 1) * self.duration
        return count <= self.num_requests

    def wait(self):
        return max(self.window_end - self.now, 0)
