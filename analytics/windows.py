"""The recent windows operators read during an incident: the last hour and the last 24 hours
before a run (analytics.figures.window_figures computes their figures from the run's hour rows).

A window is whole hours (the hour rows' grain): the hours that start at or after `now` less its
span, truncated to the hour. At 12:20 the last hour is 11:00-12:20 (80 minutes), the last 24
hours yesterday's 12:00 to 12:20 today (24 h 20 min): never less than the span. `now` is the
run's: the figures are as fresh as the last run (docs/analytics.md, "The last hour and the last
24 hours").

Light on purpose (no pyarrow, no Spark): the web processes read these to label what they serve.
"""

from datetime import timedelta

WINDOWS = {"1h": timedelta(hours=1), "24h": timedelta(hours=24)}


def start_of(now, span):
    """The first hour a window of `span` ending at `now` holds."""
    return (now - span).replace(minute=0, second=0, microsecond=0)
