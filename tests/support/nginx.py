"""Debian's nginx with the repository's site file (deploy/nginx/mqsite.conf) in front of a test
server: the file as shipped, changed only in its ports, its certificate's paths, its access
log's path and its static root, inside a minimal main configuration that keeps nginx's pid,
logs and temporary files in a folder of the test's own."""

import datetime
import ipaddress
import os
import socket
import subprocess
import time
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.support.servers import ROOT, free_port

NGINX = "/usr/sbin/nginx"  # Debian's (the Makefile's TEST_TOOLS installs nginx-light)
SITE = ROOT / "deploy" / "nginx" / "mqsite.conf"


def self_signed_certificate(folder):
    """A certificate for 127.0.0.1 and localhost, and its key: (cert path, key path)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = Path(folder) / "cert.pem", Path(folder) / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path


def _replace(text, old, new):
    """Replace `old` everywhere, failing when it is not there: a site file that changed shape
    must fail the test, not run it half templated."""
    if old not in text:
        raise AssertionError(f"deploy/nginx/mqsite.conf no longer has {old!r}: update tests/support/nginx.py")
    return text.replace(old, new)


def _has_ipv6_loopback():
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def site_for_test(upstream_port, http_port, https_port, cert, key, static_parent):
    """The site file with the test's ports (on loopback), certificate and static root. Its IPv6
    listens go where the machine has no IPv6 (many containers)."""
    text = SITE.read_text()
    v6 = _has_ipv6_loopback()
    text = _replace(text, "server 127.0.0.1:8000;", f"server 127.0.0.1:{upstream_port};")
    text = _replace(text, "listen 80;", f"listen 127.0.0.1:{http_port};")
    text = _replace(text, "listen [::]:80;", f"listen [::1]:{http_port};" if v6 else "")
    text = _replace(text, "listen 443 ssl;", f"listen 127.0.0.1:{https_port} ssl;")
    text = _replace(text, "listen [::]:443 ssl;", f"listen [::1]:{https_port} ssl;" if v6 else "")
    text = _replace(text, "/etc/letsencrypt/live/mq.example.com/fullchain.pem", str(cert))
    text = _replace(text, "/etc/letsencrypt/live/mq.example.com/privkey.pem", str(key))
    text = _replace(text, "/var/log/nginx/mqsite.access.log", str(Path(cert).parent / "mqsite.access.log"))
    return _replace(text, "root /opt/mqsite/var;", f"root {static_parent};")


class Nginx:
    def __init__(self, folder, proc, http_port, https_port):
        self.folder, self.proc = Path(folder), proc
        self.http = f"http://127.0.0.1:{http_port}"
        self.https = f"https://127.0.0.1:{https_port}"
        self.wss = f"wss://127.0.0.1:{https_port}/ws/"

    def errors(self):
        return (self.folder / "error.log").read_text(errors="replace")

    def access_log(self):
        """The site's own access log (its log_format mqsite)."""
        return (self.folder / "mqsite.access.log").read_text(errors="replace")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()  # nginx's fast shutdown
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_nginx(folder, upstream_port, cert, key, static_parent):
    """nginx in the foreground, serving the site file on two free ports (http, https)."""
    folder = Path(folder)
    http_port, https_port = free_port(), free_port()
    (folder / "site.conf").write_text(
        site_for_test(upstream_port, http_port, https_port, cert, key, static_parent)
    )
    temp = folder / "temp"
    temp.mkdir()
    # As root nginx's workers would run as nobody, who cannot read the test's private folders.
    user = "user root;" if os.geteuid() == 0 else ""
    (folder / "nginx.conf").write_text(
        f"""{user}
worker_processes 1;
pid {folder}/nginx.pid;
error_log {folder}/error.log warn;
events {{ worker_connections 256; }}
http {{
    include /etc/nginx/mime.types;
    access_log {folder}/access.log;
    client_body_temp_path {temp}/body;
    proxy_temp_path {temp}/proxy;
    fastcgi_temp_path {temp}/fastcgi;
    uwsgi_temp_path {temp}/uwsgi;
    scgi_temp_path {temp}/scgi;
    include {folder}/site.conf;
}}
"""
    )
    conf = str(folder / "nginx.conf")
    check = subprocess.run(
        [NGINX, "-t", "-q", "-p", str(folder), "-e", str(folder / "error.log"), "-c", conf],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, f"nginx -t: {check.stderr}"
    proc = subprocess.Popen(
        [NGINX, "-p", str(folder), "-e", str(folder / "error.log"), "-c", conf, "-g", "daemon off;"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    server = Nginx(folder, proc, http_port, https_port)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"nginx exited: {server.errors()[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", https_port)) == 0:
                return server
        time.sleep(0.05)
    server.stop()
    raise RuntimeError(f"nginx did not listen within 10 s: {server.errors()[-2000:]}")
