"""mqclient: the Python client of the mqsite message queue (sync and asyncio)."""

from .client import AsyncClient, Client
from .delivery import AsyncDelivery, Delivery
from .errors import (
    InsecureURLWarning,
    MQAuthError,
    MQBadRequest,
    MQConnectionError,
    MQError,
    MQForbidden,
    MQNotFound,
    MQRedirectError,
    MQSchemaMismatch,
    MQThrottled,
)

__all__ = [
    "AsyncClient",
    "AsyncDelivery",
    "Client",
    "Delivery",
    "InsecureURLWarning",
    "MQAuthError",
    "MQBadRequest",
    "MQConnectionError",
    "MQError",
    "MQForbidden",
    "MQNotFound",
    "MQRedirectError",
    "MQSchemaMismatch",
    "MQThrottled",
]
__version__ = "1.1.0"
