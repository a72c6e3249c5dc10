"""The SSRF rule for webhook URLs: which addresses a webhook may be posted to. Ground floor, so
that the URL is checked by the same rule where it is entered (subscribers.models, the admin, the
commands) and where it is posted (delivery.webhooks, which resolves once and connects to the
address it checked)."""

import ipaddress
import socket
from urllib.parse import urlsplit

from django.conf import settings


class UnsafeURL(ValueError):
    """A webhook URL we refuse to post to (SSRF guard) or cannot use at all."""


NAT64 = ipaddress.ip_network("64:ff9b::/96")
# IPv4-compatible IPv6 (::a.b.c.d, deprecated by RFC 4291): Python counts ::127.0.0.1 global.
IPV4_COMPATIBLE = ipaddress.ip_network("::/96")


def _refused(ip):
    """Loopback, private, link-local (cloud metadata at 169.254.169.254), multicast, reserved
    and every other non-global address, and IPv6 site-local (fec0::/10, deprecated, which
    Python counts global). An IPv4 address carried inside IPv6 (mapped, compatible, NAT64,
    6to4, Teredo) is judged as the IPv4 address it reaches."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip in NAT64 or ip in IPV4_COMPATIBLE:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        else:
            embedded = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if (embedded is not None and _refused(embedded)) or ip.is_site_local:
            return True
    return not ip.is_global or ip.is_multicast


def parse_url(url):
    """Split a webhook URL, checking what needs no DNS: scheme, host, no credentials."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise UnsafeURL("a webhook URL must be http:// or https://")
    if not parts.hostname:
        raise UnsafeURL("a webhook URL needs a host")
    if parts.username or parts.password:
        raise UnsafeURL("a webhook URL may not carry credentials")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise UnsafeURL("the webhook URL's port is not valid") from None
    return parts, port


class Unresolvable(UnsafeURL):
    pass


def resolve_safe(url):
    """The address to connect to for `url`: resolved once, checked, and then used, so that a
    DNS answer that changes between check and connect (rebinding) cannot slip past."""
    parts, port = parse_url(url)
    try:
        infos = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise Unresolvable(f"cannot resolve {parts.hostname}: {exc}") from None
    addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
    if not settings.MQ_WEBHOOK_ALLOW_PRIVATE:
        bad = [str(a) for a in addresses if _refused(a)]
        if bad:
            raise UnsafeURL(
                f"{parts.hostname} resolves to a loopback, private or link-local address ({bad[0]});"
                " set MQ_WEBHOOK_ALLOW_PRIVATE=true to allow it"
            )
    return parts, port, addresses[0]


def check_url(url):
    """Validate a webhook URL where it is entered (admin, commands): the same rule as at send.
    A name that does not resolve yet is let in: the check at send time is the one that counts
    (DNS answers change), and it refuses the post then."""
    try:
        resolve_safe(url)
    except Unresolvable:
        pass
