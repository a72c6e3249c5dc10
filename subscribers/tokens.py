"""API tokens and webhook secrets.

Tokens are 256-bit random strings, so a fast hash is enough to make a stolen table useless
(no dictionary to try); they are stored as SHA-256 and compared in constant time.
"""

import base64
import hashlib
import hmac
import secrets

TOKEN_PREFIX = "mq_"  # noqa: S105 (a prefix, not a secret)


def new_token():
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token):
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def token_matches(token, token_hash):
    return hmac.compare_digest(hash_token(token), token_hash)


def new_webhook_secret():
    """A Standard Webhooks secret: `whsec_` and base64 of 24 random bytes."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
