"""A W3C trace context, as a traced publisher sends it in its messages' headers: the tests of
headers check it arrives on every delivery byte for byte."""

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TRACESTATE = "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"
