"""Progress bars only on a terminal: on a pipe or in a file (a Kubernetes pod's log, ``radixserve engine > log``,
``radixserve up``'s tagged output) a tqdm bar is a line of carriage returns and block characters (regression: every
engine pod log held "Loading weights: 82%|████████▏ | 224/272"; only ``radixserve up`` set ``TQDM_DISABLE``).

One rule for the engine's own bar (weight loading, ``model/loader.py``) and those of the libraries it calls
(transformers' and huggingface_hub's: GGUF dequantizing, shard loading): shown when stderr, where tqdm writes, is a
terminal and ``TQDM_DISABLE`` is unset or empty (tqdm's own switch: any other value turns its bars off).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import TextIO

TQDM_DISABLE_ENV = "TQDM_DISABLE"


def progress_bars_enabled(stream: TextIO | None = None, environ: Mapping[str, str] | None = None) -> bool:
    """True when progress bars may be drawn on ``stream`` (default ``sys.stderr``): it is a terminal and
    ``TQDM_DISABLE`` is unset or empty in ``environ`` (default ``os.environ``). A closed or detached stream counts
    as no terminal."""
    stream = sys.stderr if stream is None else stream
    environ = os.environ if environ is None else environ
    if environ.get(TQDM_DISABLE_ENV):
        return False
    try:
        return stream is not None and stream.isatty()
    except (ValueError, AttributeError):  # closed, or replaced by an object without isatty
        return False


def quiet_library_progress_bars() -> bool:
    """Turn off transformers' and huggingface_hub's progress bars unless ``progress_bars_enabled()``; returns
    whether bars stay on. Call before the engine loads its tokenizer and model."""
    if progress_bars_enabled():
        return True
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # and huggingface_hub's bars
    return False
