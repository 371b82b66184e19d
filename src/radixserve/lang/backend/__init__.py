"""Backends: where a program's gens and selects go (``RuntimeEndpoint``: a radixserve router or engine)."""

from radixserve.lang.backend.base import Backend, PrefixTokens
from radixserve.lang.backend.runtime_endpoint import RuntimeEndpoint, RuntimeEndpointError

__all__ = ["Backend", "PrefixTokens", "RuntimeEndpoint", "RuntimeEndpointError"]
