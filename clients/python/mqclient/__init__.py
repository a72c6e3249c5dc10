"""mqclient: the Python client of the mqsite message queue (sync and asyncio)."""

from .answers import Acked, Answer, Extended, Published, Receipt, Subscription
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
    "Acked",
    "Answer",
    "AsyncClient",
    "AsyncDelivery",
    "Client",
    "Delivery",
    "Extended",
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
    "Published",
    "Receipt",
    "Subscription",
]
__version__ = "1.2.3"
