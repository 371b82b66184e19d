"""A tiny randomly initialised Llama checkpoint with the demo model's tokenizer files, for engine tests that need a
real ``ModelRunner`` / ``Engine`` but not the real weights (fast: ~13 MB of fp32 weights, loads in well under 1 s)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from conftest import MODEL_DIR

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def write_tiny_model(
    path: Path,
    max_position_embeddings: int = 2048,
    hidden_size: int = 64,
    head_dim: int = 16,
    tokenizer_dir: str = MODEL_DIR,
    vocab_size: int = 49152,
) -> str:
    """Save the tiny checkpoint (2 layers, 4 query and 2 KV heads of ``head_dim``, ``hidden_size`` wide, a vocabulary
    of ``vocab_size``: by default the tokenizer's 49152) and the tokenizer files of ``tokenizer_dir`` into ``path``;
    returns the directory. Skips the test when the tokenizer is not there (run ``make install``)."""
    if not os.path.exists(os.path.join(tokenizer_dir, "tokenizer.json")):
        pytest.skip(f"no tokenizer.json in {tokenizer_dir}; run `make install`")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=2,
        bos_token_id=1,
    )
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    for f in TOKENIZER_FILES:
        if os.path.exists(os.path.join(tokenizer_dir, f)):
            shutil.copy(os.path.join(tokenizer_dir, f), path / f)
    return str(path)
