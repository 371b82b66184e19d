"""Weight loading: iterate ``(name, tensor)`` from safetensors shards or a GGUF file and copy into our model.

HF's separate ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj`` tensors go into shards of the fused
``qkv_proj`` / ``gate_up_proj`` parameters (nano-vllm's ``packed_modules_mapping`` idea). Every parameter must be
written exactly once, else loading fails loudly rather than running with uninitialised memory.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterator

import torch
from tqdm import tqdm

from radixserve.engine.model.llama import LlamaForCausalLM
from radixserve.engine.model.locate import is_gguf_path
from radixserve.engine.progress import progress_bars_enabled

logger = logging.getLogger(__name__)

# HF sub-name -> (our fused parameter, shard index)
_PACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def iter_safetensors(model_dir: str) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
    """``(num_tensors, iterator)`` over every tensor of a (possibly sharded) safetensors HF directory.

    Raises FileNotFoundError when the directory holds no ``*.safetensors``.
    """
    from safetensors import safe_open

    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_dir, x) for x in files]
    else:
        files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    names: list[tuple[str, str]] = []
    for path in files:
        with safe_open(path, framework="pt") as f:
            names.extend((path, k) for k in f.keys())

    def gen() -> Iterator[tuple[str, torch.Tensor]]:
        handles: dict[str, object] = {}
        try:
            for path, k in names:
                if path not in handles:
                    handles.clear()  # one shard open at a time
                    handles[path] = safe_open(path, framework="pt")
                yield k, handles[path].get_tensor(k)  # type: ignore[attr-defined]
        finally:
            handles.clear()

    return len(names), gen()


def iter_gguf(gguf_path: str) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
    """Dequantize a GGUF file through transformers (its GGUF loader un-permutes q/k) and iterate its state dict."""
    from transformers import AutoModelForCausalLM

    d, f = os.path.split(os.path.abspath(gguf_path))
    logger.info("dequantizing %s through transformers (takes a while)", gguf_path)
    hf = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    sd = hf.state_dict()
    del hf
    return len(sd), iter(sd.items())


def load_weights(model: LlamaForCausalLM, model_path: str) -> None:
    """Fill ``model``'s (materialised) parameters from ``model_path`` (HF dir or ``.gguf``), with a tqdm bar on a
    terminal only (``progress_bars_enabled``: none in a log file or pipe).

    Raises:
        KeyError: a checkpoint tensor has no matching parameter.
        ValueError: a shape mismatch, or parameters left unloaded.
    """
    params = dict(model.named_parameters())
    cfg = model.config
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shard_rows = {
        "qkv_proj": [(0, q_size), (q_size, kv_size), (q_size + kv_size, kv_size)],
        "gate_up_proj": [(0, cfg.intermediate_size), (cfg.intermediate_size, cfg.intermediate_size)],
    }
    total, it = iter_gguf(model_path) if is_gguf_path(model_path) else iter_safetensors(model_path)
    loaded: set[str] = set()
    bar = tqdm(it, total=total, desc="Loading weights", unit="tensor", disable=not progress_bars_enabled())
    for name, tensor in bar:
        if "rotary_emb" in name:
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: the embedding matrix is the head
        target, rows = name, None
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in _PACKED:
            fused, shard = _PACKED[parts[-2]]
            target = ".".join(parts[:-2] + [fused, parts[-1]])
            rows = shard_rows[fused][shard]
        if target not in params:
            raise KeyError(f"checkpoint tensor {name!r} has no parameter in {cfg.architecture}")
        dst = params[target].data
        if rows is not None:
            dst = dst.narrow(0, rows[0], rows[1])
            target = f"{target}#{rows[0]}"
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != parameter {tuple(dst.shape)}")
        dst.copy_(tensor)
        loaded.add(target)
    expected: set[str] = set()
    for pname in params:
        fused = pname.split(".")[-2] if "." in pname else ""
        if fused in shard_rows:
            expected.update(f"{pname}#{r[0]}" for r in shard_rows[fused])
        else:
            expected.add(pname)
    missing = expected - loaded
    if missing:
        raise ValueError(f"weights missing from {model_path}: {sorted(missing)[:8]} ({len(missing)} in all)")
