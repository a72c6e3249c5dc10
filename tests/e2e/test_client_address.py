"""The client's address (mqsite/client_address.py): X-Forwarded-For is believed only from a
trusted proxy, so a client naming a new address each time does not escape the anonymous
throttle nor the failed-token throttle; behind a trusted proxy, each forwarded client counts
alone. Against real Daphne processes."""

import time

import httpx
import pytest
from django.test import override_settings
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from mqsite.client_address import client_address
from tests.support.servers import start_daphne

LIMIT = 5
LIMITED = {"MQ_THROTTLE_RATE": f"{LIMIT}/h", "MQ_AUTH_FAILURES_PER_MINUTE": str(LIMIT)}


def away_from_a_minutes_end():
    """The failed-token counter's windows are whole minutes: start where one has time left."""
    if time.time() % 60 > 50:
        time.sleep(61 - time.time() % 60)


def schema_calls(web, addresses):
    return [
        httpx.get(f"{web.http}/api/schema/", headers={"X-Forwarded-For": a}, timeout=30).status_code
        for a in addresses
    ]


def bad_token_calls(web, addresses):
    return [
        httpx.get(
            f"{web.http}/api/deliveries",
            headers={"Authorization": "Bearer mq_wrong", "X-Forwarded-For": a},
            timeout=30,
        ).status_code
        for a in addresses
    ]


def bad_socket_close(web, address):
    with connect(f"{web.ws}?token=mq_wrong", additional_headers={"X-Forwarded-For": address}) as ws:
        try:
            ws.recv(timeout=10)
        except ConnectionClosed as closed:
            return closed.rcvd.code
    return None


@pytest.mark.django_db(transaction=True)
def test_a_forged_x_forwarded_for_escapes_no_throttle():
    web = start_daphne(LIMITED)
    try:
        away_from_a_minutes_end()
        addresses = [f"10.1.0.{i}" for i in range(2 * LIMIT)]
        # anonymous calls, each claiming another address: counted as the one peer they are
        assert schema_calls(web, addresses) == [200] * LIMIT + [429] * LIMIT
        # bad tokens the same, over REST and then over the socket
        assert bad_token_calls(web, addresses) == [401] * LIMIT + [429] * LIMIT
        assert bad_socket_close(web, "10.9.9.9") == 4429
    finally:
        web.stop()


@pytest.mark.django_db(transaction=True)
def test_behind_a_trusted_proxy_each_forwarded_client_counts_alone():
    web = start_daphne({**LIMITED, "MQ_TRUSTED_PROXIES": "127.0.0.0/8"})  # this test is the proxy
    try:
        away_from_a_minutes_end()
        many = [f"10.1.0.{i}" for i in range(2 * LIMIT)]
        assert schema_calls(web, many) == [200] * len(many)
        assert bad_token_calls(web, many) == [401] * len(many)
        # one forwarded client is still throttled, whatever it puts in front of the proxy's entry
        assert schema_calls(web, [f"6.6.6.{i}, 10.2.0.1" for i in range(LIMIT + 1)])[-1] == 429
        assert bad_socket_close(web, "10.3.0.1") == 4401
    finally:
        web.stop()


@override_settings(MQ_TRUSTED_PROXIES=["10.0.0.0/8", "::1"])
def test_the_address_is_the_first_untrusted_hop_from_the_right():
    assert client_address("10.0.0.2", "1.2.3.4, 5.6.7.8, 10.0.0.3") == "5.6.7.8"
    assert client_address("::1", "2001:db8::1") == "2001:db8::1"
    assert client_address("10.0.0.2", "10.0.0.9, 10.0.0.3") == "10.0.0.9"  # all trusted: the outermost
    assert client_address("10.0.0.2", "unknown") == "10.0.0.2"  # not an address: the proxy's
    assert client_address("192.0.2.7", "1.2.3.4") == "192.0.2.7"  # an untrusted peer's header
    assert client_address("10.0.0.2", "") == "10.0.0.2"
