"""Deliver while publishing (issue 28): a publish made in this process hands its new
deliveries straight to this process's sockets that have room, in its own statement.

Otherwise a delivery takes a publish commit, a wake-up, the socket's lease (a statement and a
commit of its own) and a frame built from the leased row. Here the publish statement makes the
delivery already in flight to the socket (ledger._fan_out_seated: leased as a lease would leave
it, and only where a lease would take it now), and the frame goes out right after the commit,
built from the payload text the publisher sent: one commit, no wake-up, no lease statement.

A seat is room held in a socket's window from before the statement until what it got is
counted in the window and sent, so that the socket's own leases meanwhile keep within its
prefetch. Only unordered queues (an ordered queue's line is the lease's alone), only sockets
past their resume grace, and not subscribers whose sockets are spread over several processes
(their stream is dealt out in turns across processes: delivery.wakeups). Whatever is not seated
is made pending and woken as before. A socket that closes waits for its seats before it
releases what it holds (DeliveryConsumer.release), and a process that dies is released by
delivery.liveness: a seated delivery is a lease like any other.
"""

import asyncio
from collections import defaultdict
from typing import NamedTuple

from . import wakeups

# queue id -> this process's sockets that receive it (DeliveryConsumer), in turn order
_listening = defaultdict(list)


def listen(socket, queue_ids):
    """The socket receives these queues (its subscriptions): publishes to them may seat it."""
    if socket.closing:  # it closed while it was opening: forget() has been and gone
        return
    for queue_id in queue_ids:
        line = _listening[queue_id]
        if socket not in line:
            line.append(socket)


def forget(socket):
    """The socket is closing: seat it no more."""
    for queue_id in [q for q, line in _listening.items() if socket in line]:
        line = _listening[queue_id]
        line.remove(socket)
        if not line:
            del _listening[queue_id]


class Seat(NamedTuple):
    socket: object
    room: int
    done: asyncio.Future  # set once what it got is held and sent (or it got nothing)


def take(queue, count):
    """Seats for a publish of `count` messages to `queue`: per subscriber with a socket here
    that has room (the first in turn, which then goes to the back), up to `count` of it. []
    when none."""
    if queue.ordered or not (line := _listening.get(queue.pk)):
        return []
    loop = asyncio.get_running_loop()
    seats, seen = [], set()
    for socket in list(line):
        pk = socket.subscriber.pk
        if pk in seen or wakeups.shared_with_other_processes(pk):
            continue
        room = min(socket.room(), count)
        if room <= 0:
            continue
        seen.add(pk)
        line.append(line.pop(line.index(socket)))  # its turn is taken
        seat = Seat(socket, room, loop.create_future())
        socket.reserve(seat)
        seats.append(seat)
    return seats


def statement_seats(seats):
    """The arrays the publish statement takes: [subscriber id], [holder], [room]."""
    return (
        [s.socket.subscriber.pk for s in seats],
        [s.socket.channel_name for s in seats],
        [s.room for s in seats],
    )


def hand_over(seats, taken):
    """After the commit: each seat's socket counts and sends what it got (`taken`, {holder:
    [(subscription id, delivery)]}), in a task of its own, so that the publisher's answer does
    not wait for it."""
    for seat in seats:
        got = taken.get(seat.socket.channel_name)
        if not got:  # a lease would not have taken it either (paused, a replay, ...)
            seat.socket.unreserve(seat)
            continue
        task = asyncio.ensure_future(seat.socket.take_seated(seat, got))
        _running.add(task)
        task.add_done_callback(_running.discard)


def cancel(seats):
    """The publish failed: the seats are given back, nothing was made for them."""
    for seat in seats:
        seat.socket.unreserve(seat)


_running = set()  # hand-over tasks (referenced, or they could be collected while running)
