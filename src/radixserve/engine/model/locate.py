"""Check ``--model-path`` / ``--tokenizer-path`` before anything loads: one clear line instead of a transformers
traceback, and never a hub lookup (regression: a missing directory ended in "Repo id must be in the form
'repo_name'...", a hub id such as ``HuggingFaceTB/SmolLM2-135M-Instruct`` hung ~50 s trying the hub offline, and
``radixserve up`` restarted such an engine forever).

What the loader accepts (``loader.py``, ``config.py``): a directory holding ``config.json`` and ``*.safetensors``
weights (one file, or shards listed by ``model.safetensors.index.json``), or a ``.gguf`` file. Only the file system
is read here (no torch, no transformers).
"""

from __future__ import annotations

import glob
import os
import re

# ``org/name`` as the Hugging Face hub spells repo ids: one slash, no leading dot or slash.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_EXPECTED = "expected a model directory with config.json and *.safetensors weights, or a .gguf file"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class ModelPathError(ValueError):
    """A model or tokenizer path the engine cannot load; ``str()`` is one line for the user."""


def looks_like_hub_id(path: str) -> bool:
    """``org/name`` that is not a local path: the form vLLM/SGLang users pass to download from the hub. A missing
    path whose parent directory exists (``models/typo``) is a local typo, not a hub id."""
    return bool(_HUB_ID.fullmatch(path)) and not os.path.exists(path) and not os.path.isdir(path.split("/")[0])


def _missing(path: str, flag: str) -> ModelPathError:
    if looks_like_hub_id(path):
        name = path.split("/")[1]
        return ModelPathError(
            f"{flag} {path}: no such file or directory; it looks like a Hugging Face hub id, and radixserve loads "
            f"local files only: download it first, e.g. `hf download {path} --local-dir models/{name}`, then pass "
            f"{flag} models/{name}"
        )
    return ModelPathError(f"{flag} {path}: no such file or directory ({_EXPECTED})")


def _check_gguf(path: str, flag: str) -> None:
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelPathError(f"{flag} {path}: cannot read it ({e.strerror})") from e
    if magic != b"GGUF":
        raise ModelPathError(f"{flag} {path}: not a GGUF file (no GGUF header; a Git LFS pointer not pulled?)")
    from radixserve.engine.model.gguf_header import GGUFHeaderError, check_gguf_complete

    try:
        check_gguf_complete(path)
    except GGUFHeaderError as e:  # regression: a truncated file failed later with "cannot reshape array of size ..."
        raise ModelPathError(f"{flag} {path}: not a complete GGUF file: {e}") from e
    except OSError as e:
        raise ModelPathError(f"{flag} {path}: cannot read it ({e.strerror})") from e


def is_gguf_path(path: str) -> bool:
    """Whether ``path`` names a GGUF file by its extension, in any case (``model.GGUF`` too)."""
    return path.lower().endswith(".gguf")


def _ggufs_in(directory: str) -> list[str]:
    return sorted(os.path.join(directory, n) for n in os.listdir(directory) if is_gguf_path(n))


def check_model_path(path: str, flag: str = "--model-path") -> None:
    """Raise ModelPathError (a ValueError) unless ``path`` is something the loader accepts: a directory with
    ``config.json`` and ``*.safetensors`` weights, or a ``.gguf`` file. Reads only the file system."""
    if not path:
        raise ModelPathError(f"{flag} is empty ({_EXPECTED})")
    if not os.path.exists(path):
        raise _missing(path, flag)
    if os.path.isfile(path):
        if is_gguf_path(path):
            _check_gguf(path, flag)
            return
        raise ModelPathError(f"{flag} {path}: a file, but not a .gguf ({_EXPECTED})")
    if not os.path.isdir(path):
        raise ModelPathError(f"{flag} {path}: neither a directory nor a file ({_EXPECTED})")
    ggufs = _ggufs_in(path)
    has_weights = bool(glob.glob(os.path.join(path, "*.safetensors"))) or os.path.isfile(
        os.path.join(path, "model.safetensors.index.json")
    )
    if not os.path.isfile(os.path.join(path, "config.json")):
        if len(ggufs) == 1 and not has_weights:
            raise ModelPathError(f"{flag} {path}: a directory with a GGUF file; pass the file itself: {ggufs[0]}")
        if ggufs and not has_weights:  # regression: two files, only the first named
            raise ModelPathError(
                f"{flag} {path}: a directory with {len(ggufs)} GGUF files; pass one of them: {', '.join(ggufs)}"
            )
        raise ModelPathError(f"{flag} {path}: no config.json in this directory ({_EXPECTED})")
    if not has_weights:
        others = [
            os.path.basename(p)
            for p in sorted(glob.glob(os.path.join(path, "*.bin")) + glob.glob(os.path.join(path, "*.pt")))
        ]
        found = f"; found {', '.join(others[:3])}, but only safetensors weights are supported" if others else ""
        raise ModelPathError(f"{flag} {path}: no *.safetensors weights in this directory{found} ({_EXPECTED})")


def check_tokenizer_path(path: str, flag: str = "--tokenizer-path") -> None:
    """Raise ModelPathError unless ``path`` is a ``.gguf`` file or a directory holding a Hugging Face tokenizer
    (``tokenizer.json``, ``tokenizer_config.json`` or ``tokenizer.model``)."""
    if not os.path.exists(path):
        raise _missing(path, flag)
    if os.path.isfile(path):
        if is_gguf_path(path):
            _check_gguf(path, flag)
            return
        raise ModelPathError(f"{flag} {path}: a file, but not a .gguf (expected a tokenizer directory or a .gguf file)")
    if not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        raise ModelPathError(
            f"{flag} {path}: no tokenizer in this directory (expected one of {', '.join(_TOKENIZER_FILES)})"
        )


def check_model_paths(model_path: str, tokenizer_path: str | None = None) -> None:
    """``check_model_path(model_path)``, and ``check_tokenizer_path(tokenizer_path)`` when one is given."""
    check_model_path(model_path)
    if tokenizer_path:
        check_tokenizer_path(tokenizer_path)
