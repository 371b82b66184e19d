"""A GGUF file's config and tokenizer as a small Hugging Face directory, written once by a child process.

transformers reads a ``.gguf``'s config and tokenizer by parsing the whole file twice (every metadata value, the
49k-string vocabulary included): 2-5 s each on 2 cores, and ~200 MiB of Python objects that the engine's heap keeps
afterwards. Here a child process (``python -m radixserve.engine.model.gguf_sidecar GGUF DIR``) does it once and saves
``config.json`` and the tokenizer files (chat template included) with ``save_pretrained``; the engine then loads both
from that directory in well under a second, and its own heap never holds the parse. Files under 32 MiB (test models)
are parsed in-process instead.

The directory is ``<cache>/gguf/<name>-<key>`` under the radixserve cache (``$XDG_CACHE_HOME/radixserve``, or
``$RADIXSERVE_GGUF_CACHE_DIR``), where ``key`` hashes the file's absolute path, size and modification time: a
replaced file gets a new directory. Writes go to a temporary directory renamed into place, so concurrent engines
(``radixserve up --engines 2``) never read a half-written one.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

CACHE_DIR_ENV = "RADIXSERVE_GGUF_CACHE_DIR"
_DONE = "sidecar.done"  # written last: its presence means the directory is complete
_TOKENIZER_ERROR = "tokenizer.error"  # why transformers could not build the file's tokenizer, when it could not
_TIMEOUT_S = 600
# Smaller files (test models, tiny vocabularies) are parsed in-process: a child's start (~3 s) would cost more.
IN_PROCESS_MAX_BYTES = 32 << 20


def sidecar_root() -> Path:
    """``$RADIXSERVE_GGUF_CACHE_DIR``, else ``$XDG_CACHE_HOME/radixserve/gguf`` (``~/.cache/radixserve/gguf``)."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "radixserve" / "gguf"


def sidecar_dir(gguf_path: str) -> Path:
    """Where ``gguf_path``'s config and tokenizer are kept (not created here). Raises OSError if it cannot be read."""
    path = os.path.abspath(gguf_path)
    st = os.stat(path)
    key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    name = os.path.basename(path).rsplit(".", 1)[0]
    return sidecar_root() / f"{name}-{key}"


def ensure_sidecar(gguf_path: str) -> Path:
    """The HF directory (``config.json`` + tokenizer files) of ``gguf_path``, written by a child process if missing.

    Raises:
        ValueError: transformers could not read the file's config (the child's last error line).
        OSError: the cache directory cannot be written.
    """
    target = sidecar_dir(gguf_path)
    if (target / _DONE).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [sys.executable, "-m", "radixserve.engine.model.gguf_sidecar", os.path.abspath(gguf_path), str(target)],
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
        env={**os.environ, "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"},
    )
    if proc.returncode != 0 or not (target / _DONE).exists():
        lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        raise ValueError(f"{gguf_path}: transformers cannot read its config: {lines[-1] if lines else 'no output'}")
    return target


def sidecar_tokenizer_dir(gguf_path: str) -> Path:
    """``ensure_sidecar(gguf_path)``, checked to hold the file's tokenizer.

    Raises ValueError naming why transformers could not build the tokenizer (e.g. a GGUF without a vocabulary), and
    what ``ensure_sidecar`` raises."""
    target = ensure_sidecar(gguf_path)
    error = target / _TOKENIZER_ERROR
    if error.exists():
        raise ValueError(f"{gguf_path}: transformers cannot build its tokenizer: {error.read_text().strip()}")
    return target


def load_gguf_config(gguf_path: str) -> Any:
    """transformers ``AutoConfig`` of a ``.gguf``: from its sidecar directory, or parsed in-process for a file under
    ``IN_PROCESS_MAX_BYTES``. Raises ValueError when transformers cannot read it."""
    from transformers import AutoConfig

    if os.path.getsize(gguf_path) < IN_PROCESS_MAX_BYTES:
        d, f = os.path.split(os.path.abspath(gguf_path))
        return AutoConfig.from_pretrained(d, gguf_file=f)
    return AutoConfig.from_pretrained(ensure_sidecar(gguf_path))


def load_gguf_tokenizer(gguf_path: str) -> Any:
    """transformers tokenizer of a ``.gguf`` (chat template included), as ``load_gguf_config`` finds it. Raises
    ValueError when transformers cannot build it."""
    from transformers import AutoTokenizer

    if os.path.getsize(gguf_path) < IN_PROCESS_MAX_BYTES:
        d, f = os.path.split(os.path.abspath(gguf_path))
        return AutoTokenizer.from_pretrained(d, gguf_file=f)
    return AutoTokenizer.from_pretrained(sidecar_tokenizer_dir(gguf_path))


def write_sidecar(gguf_path: str, target: Path) -> None:
    """Parse ``gguf_path`` with transformers and save its config and tokenizer into ``target`` (atomically); a
    tokenizer transformers cannot build leaves its reason in ``tokenizer.error`` instead."""
    from transformers import AutoConfig, AutoTokenizer

    d, f = os.path.split(os.path.abspath(gguf_path))
    config = AutoConfig.from_pretrained(d, gguf_file=f)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        config.save_pretrained(tmp)
        try:  # a file without a tokenizer still has a config (a tokenizer may come from --tokenizer-path)
            AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(tmp)
        except Exception as e:
            (tmp / _TOKENIZER_ERROR).write_text(f"{type(e).__name__}: {e}".splitlines()[0])
        (tmp / _DONE).write_text(os.path.abspath(gguf_path) + "\n")
        try:
            os.replace(tmp, target)
        except OSError:  # another engine finished first: its directory is as good
            if not (target / _DONE).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":  # pragma: no cover - run by ensure_sidecar in a child process
    write_sidecar(sys.argv[1], Path(sys.argv[2]))
