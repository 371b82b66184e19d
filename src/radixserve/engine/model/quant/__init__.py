"""Quantized weights on CPU (issue 14): GGUF weights kept quantized (read GGUF tensors, turn GGML blocks into the
layout of torch's CPU weight-only int4 kernel) and dense checkpoints quantized at load, with the modules the Llama
forward runs them with.

- ``gguf_file.py``: a GGUF file's tensors by name (``gguf.GGUFReader``, memory-mapped), their GGML type and raw blocks.
- ``ggml_blocks.py``: GGML's Q4_0 / Q4_1 / Q8_0 blocks split into integer codes and fp16 scales (no rounding).
- ``affine.py``: ``Int4Affine``, a weight as 4-bit codes with a scale and zero per group of 32, exactly equal to its
  GGML blocks; row permutation and concatenation along N (the fused q/k/v and gate/up) act on it exactly.
- ``rope_permute.py``: the row order that undoes llama.cpp's q/k permutation (as transformers' GGUF loader does).
- ``int4_cpu.py``: packing for ``aten._weight_int4pack_mm_for_cpu`` and the matmul itself.
- ``linear.py`` / ``embedding.py``: the modules (``Int4Linear``, ``Q8_0Embedding``).
- ``load.py``: fills a ``LlamaForCausalLM`` from a GGUF file, its projections (and LM head) kept quantized.
- ``on_load.py``: ``--torchao-config int8wo | int4wo-G``, a dense checkpoint's projections quantized at load;
  ``int8_cpu.py`` / ``int8_linear.py``: the int8 kernel (``aten._weight_int8pack_mm``) and its module.
"""
