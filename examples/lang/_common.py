"""What the examples share: the command line (``--url``, ``--api-key``) and the backend it names.

Run an example against `make run`'s router (http://127.0.0.1:8000, the default) or an engine:
``.venv/bin/python examples/lang/intent_routing.py --url http://127.0.0.1:30000``.
"""

from __future__ import annotations

import argparse
import os

import radixserve.lang as sgl


def backend_from_args(description: str) -> sgl.RuntimeEndpoint:
    """Parse ``--url`` / ``--api-key`` and make the default backend a ``RuntimeEndpoint`` there."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="a radixserve router or engine")
    parser.add_argument("--api-key", default=os.environ.get("RADIXSERVE_API_KEY") or None)
    args = parser.parse_args()
    backend = sgl.RuntimeEndpoint(args.url, api_key=args.api_key)
    sgl.set_default_backend(backend)
    return backend
