"""mqclient: the Python client of the mqsite message queue (sync and asyncio)."""

from .client import AsyncClient, Client
from .delivery import AsyncDelivery, Delivery
from .errors import (
    MQAuthError,
    MQBadRequest,
    MQConnectionError,
    MQError,
    MQForbidden,
    MQNotFound,
    MQThrottled,
)

__all__ = [
    "AsyncClient",
    "AsyncDelivery",
    "Client",
    "Delivery",
    "MQAuthError",
    "MQBadRequest",
    "MQConnectionError",
    "MQError",
    "MQForbidden",
    "MQNotFound",
    "MQThrottled",
]
__version__ = "0.1.0"
