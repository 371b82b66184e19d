"""radixserve: SGLang-style LLM serving with RadixAttention, a cache-aware router and a Kubernetes operator.

Two layers: ``radixserve.contracts`` (the seams every wing may import: constants, protocol types, the HTTP edge)
and ``radixserve.launch`` (the ``radixserve`` CLI and the local stack, which import the wings). The wings
``radixserve.engine``, ``radixserve.router`` and ``radixserve.operator`` never import each other; the rules are in
``.importlinter`` and ``make lint`` checks them.
"""

__version__ = "0.1.0"
