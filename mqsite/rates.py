"""Request rates as settings write them: DRF's "N/s", "N/min", "N/hour", "N/day", and also "N/Ks"
(N requests in K seconds, e.g. "1000/10s"), which gives a rate with a burst: DRF's own forms
allow either a burst of one second's worth or a minute's worth, nothing between."""

import functools
import re

UNITS = {"s": 1, "sec": 1, "second": 1, "m": 60, "min": 60, "minute": 60, "h": 3600, "hour": 3600}
UNITS |= {"d": 86400, "day": 86400}
_RATE = re.compile(r"\s*(\d+)\s*/\s*(\d*)\s*([a-z]+)\s*")


@functools.lru_cache(maxsize=32)
def parse_rate(text):
    """(requests, window seconds) of `text`; ValueError when it is not a rate."""
    match = _RATE.fullmatch(text.lower())
    unit = match and (match[3] if match[3] in UNITS else match[3].removesuffix("s"))  # "mins"
    if not match or unit not in UNITS or match[2] == "0" or int(match[1]) <= 0:
        raise ValueError(f"{text!r} is not a rate such as 100/s, 6000/min or 1000/10s")
    return int(match[1]), int(match[2] or 1) * UNITS[unit]
