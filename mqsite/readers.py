"""Readers that an app hands over at start to another beside it, by name: the analytics app
gives the dashboard its figures this way (analytics.apps), so that neither app imports the
other and the layers keep pointing down."""

_readers = {}


def provide(name, reader):
    """Called from an AppConfig.ready(): `reader` answers read(name)."""
    _readers[name] = reader


def read(name, *args, **kwargs):
    return _readers[name](*args, **kwargs)
