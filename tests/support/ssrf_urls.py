"""Webhook URLs the SSRF guard must refuse (delivery.webhooks), in one place: used by
tests/delivery/test_webhooks.py (these, as written) and tests/mqsite/test_attacks.py (names that resolve to
private addresses, through a stub resolver, so that no test depends on the machine's DNS)."""

UNSAFE_URLS = [
    "http://127.0.0.1/",
    "http://127.1.2.3:8080/hook",
    "http://localhost/",
    "http://[::1]/",
    "http://[::ffff:127.0.0.1]/",
    "http://[::ffff:10.0.0.1]/",
    "http://[::ffff:7f00:1]/",
    "http://0.0.0.0/",
    "http://[::]/",
    "http://10.0.0.1/",
    "http://10.255.255.255/",
    "http://172.16.0.1/",
    "http://172.31.255.254/",
    "http://192.168.0.1/",
    "http://192.168.255.255/",
    "http://169.254.169.254/latest/meta-data/",
    "http://169.254.0.1/",
    "http://[fe80::1]/",
    "http://[fc00::1]/",
    "http://[fd12:3456::1]/",
    "http://100.64.0.1/",
    "http://2130706433/",  # 127.0.0.1 in decimal
    "http://0x7f000001/",  # in hex
    "http://0177.0.0.1/",  # in octal
    "http://017700000001/",
    "http://127.1/",
    "http://0/",
    "http://224.0.0.1/",
    "http://[ff02::1]/",
    "http://240.0.0.1/",
    "http://255.255.255.255/",
    "http://198.18.0.1/",
    "http://192.0.0.1/",
    "http://[64:ff9b::7f00:1]/",
    "http://[2001:db8::1]/",
    "http://[2002:7f00:1::]/",  # 6to4 of 127.0.0.1
    "http://[2002:a00:1::]/",  # 6to4 of 10.0.0.1
    "http://localhost.localdomain/",
    "ftp://93.184.216.34/",
    "file:///etc/passwd",
    "gopher://93.184.216.34/",
    "http://user:pass@93.184.216.34/",
    "http:///nohost",
    # added with the attack tests (tests/mqsite/test_attacks.py, API7)
    "http://[::ffff:169.254.169.254]/",  # IPv4-mapped metadata
    "http://[::ffff:a9fe:a9fe]/",
    "http://[0:0:0:0:0:ffff:127.0.0.1]/",  # mapped, written long
    "http://[::ffff:192.168.1.1]/",
    "http://[::127.0.0.1]/",  # IPv4-compatible (deprecated): Python calls it global
    "http://[::7f00:1]/",
    "http://[64:ff9b::a9fe:a9fe]/",  # NAT64 of the metadata address
    "http://[2002:a9fe:a9fe::]/",  # 6to4 of it
    "http://[fd00:ec2::254]/",  # AWS metadata over IPv6
    "http://[fec0::1]/",  # site-local (deprecated): Python calls it global
    "http://2852039166/",  # 169.254.169.254 in decimal
    "http://0xa9fea9fe/",  # in hex
    "http://0251.0376.0251.0376/",  # in octal
    "http://0x7f.0x0.0x0.0x1/",  # dotted hex
    "http://127.000.000.001/",  # zero-padded
    "http://10.1/",  # short form of 10.0.0.1
    "http://100.100.100.200/",  # Alibaba Cloud metadata (shared address space)
    "https://127.0.0.1:443/",
    "http://LOCALHOST:8000/",
    "http://0.0.0.0:8080/",
    "http://[::ffff:0.0.0.0]/",
    "http://192.0.2.1/",  # documentation ranges
    "http://203.0.113.1/",
]

# Names and what a (stub) resolver answers for them: every one reaches a refused address.
PRIVATE_NAMES = {
    "localhost.": ["127.0.0.1"],
    "ip6-localhost": ["::1"],
    "ip6-loopback": ["::1"],
    "internal.example.com": ["10.1.2.3"],
    "metadata.google.internal": ["169.254.169.254"],
    "169.254.169.254.nip.io": ["169.254.169.254"],
    "localtest.me": ["127.0.0.1"],
    "mapped.example.com": ["::ffff:127.0.0.1"],
    "link-local.example.com": ["fe80::1"],
    "cgnat.example.com": ["100.64.0.1"],
    # one public and one private answer (DNS rebinding within one answer): refused
    "rebinding.example.com": ["93.184.216.34", "127.0.0.1"],
    "db.internal": ["192.168.10.5"],
}
