"""radixserve: SGLang-style LLM serving with RadixAttention, a cache-aware router and a Kubernetes operator.

The source folders ``engine/``, ``router/`` and ``operator/`` live at the top of the repository and are imported as
``radixserve.engine``, ``radixserve.router`` and ``radixserve.operator``.
"""

import os as _os

__version__ = "0.1.0"

# In a source checkout (editable install or PYTHONPATH=.), the subpackages are the sibling folders of this one.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isdir(_os.path.join(_root, "engine")) and _root not in __path__:
    __path__.append(_root)
