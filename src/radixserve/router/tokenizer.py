"""Rebuild an engine's tokenizer (and chat template) from the text files it serves, so routers store no model.

The engine serves ``GET /get_tokenizer_files`` (``radixserve.contracts.constants.ENGINE_TOKENIZER_FILES_PATH``) as
``{"model": str, "files": {name: text}}``: whatever ``tokenizer.save_pretrained(dir)`` wrote (tokenizer.json,
tokenizer_config.json, special_tokens_map.json, chat_template.jinja, ...), text files only.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any


def _check_name(name: object) -> str:
    """A plain file name (no directory part, no ``..``); ValueError otherwise, so a hostile engine cannot write
    outside the temporary directory."""
    if not isinstance(name, str) or not name or name in (".", ".."):
        raise ValueError(f"invalid tokenizer file name {name!r}")
    if "/" in name or "\\" in name or ".." in name or "\0" in name or os.sep in name:
        raise ValueError(f"tokenizer file name {name!r} must not contain path separators or '..'")
    return name


def tokenizer_from_files(files: dict[str, str]) -> Any:
    """Build a Hugging Face tokenizer from ``{file name: text}`` (an engine's ``/get_tokenizer_files`` ``files``).

    Writes the files to a ``TemporaryDirectory`` and loads it (the loaded tokenizer keeps everything in memory, so
    the directory is removed afterwards): with ``PreTrainedTokenizerFast`` when a ``tokenizer.json`` is among them
    (the class ``AutoTokenizer`` picks for it too, but ``AutoTokenizer`` imports torch: ~250 MiB more per router),
    else ``AutoTokenizer``. Raises ``ValueError`` for an empty
    mapping, a file name with a path separator or ``..``, or non-text content; whatever ``from_pretrained`` raises for
    files it cannot load (``OSError``, ``ValueError``...) propagates.
    """
    if not isinstance(files, dict) or not files:
        raise ValueError("no tokenizer files given")
    checked = {_check_name(name): text for name, text in files.items()}
    for name, text in checked.items():
        if not isinstance(text, str):
            raise ValueError(f"tokenizer file {name!r} is not text")
    with tempfile.TemporaryDirectory(prefix="radixserve-router-tokenizer-") as tmp:
        for name, text in checked.items():
            with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                f.write(text)
        # Heavy imports, only where a tokenizer is built.
        if "tokenizer.json" in checked:
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(tmp)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tmp)
