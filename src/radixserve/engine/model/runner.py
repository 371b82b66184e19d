"""ModelRunner: loads a Llama-family checkpoint into our own forward, owns the KV pool and the attention backend.

The scheduler builds a ``ForwardBatch`` (slots from its req->token table) and calls ``forward``; the runner returns the
float32 logits of each sequence's last new token (``forward_with_input_logprobs`` also scores prompt tokens). Same
role as nano-vllm's ``ModelRunner`` and SGLang's ``model_executor/model_runner.py`` (minus CUDA graphs and tensor
parallelism).
"""

from __future__ import annotations

import itertools
import logging
import os
import time

import torch

from radixserve.engine.attention.base import create_attention_backend
from radixserve.engine.context_length import check_context_length
from radixserve.engine.cpu_threads import bind_omp_threads, resolve_bind
from radixserve.engine.memory.kv_pool import KVPool
from radixserve.engine.memory.sizing import (
    PoolSize,
    format_bytes,
    memory_limit_bytes,
    process_rss_bytes,
    release_freed_memory,
    size_kv_pool,
)
from radixserve.engine.model.compile import CompiledLayers, compile_cache_dir, configure_compile_cache
from radixserve.engine.model.config import ModelConfig
from radixserve.engine.model.forward_batch import ForwardBatch, ForwardMode
from radixserve.engine.model.forward_context import forward_context
from radixserve.engine.model.llama import LlamaForCausalLM
from radixserve.engine.model.loader import load_weights
from radixserve.engine.model.locate import is_gguf_path
from radixserve.engine.model.logits import InputLogprobQuery, InputLogprobs, score_hidden_states
from radixserve.engine.model.quant.gguf_file import UnsupportedGGUFType
from radixserve.engine.model.quant.load import load_gguf_quantized
from radixserve.engine.model.quant.on_load import (
    WeightOnlyConfig,
    check_weight_only_supported,
    quantize_projections,
)

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def cpu_has_avx512_bf16(cpuinfo_path: str = "/proc/cpuinfo") -> bool:
    """True when the CPU flags list ``avx512_bf16`` (native bf16 dot products, so bf16 matmuls beat fp32)."""
    try:
        with open(cpuinfo_path) as f:
            for line in f:
                if line.startswith("flags"):
                    return "avx512_bf16" in line.split()
    except OSError:
        pass
    return False


def resolve_device(device: str) -> torch.device:
    """``auto`` -> ``cuda`` when available, else ``cpu``. Raises ValueError for cuda without CUDA."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` -> bf16 on CUDA, bf16 on CPUs with avx512_bf16, else float32. Raises ValueError for unknown names."""
    if dtype == "auto":
        if device.type == "cuda" or cpu_has_avx512_bf16():
            return torch.bfloat16
        return torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, float32, bfloat16 or float16")
    return _DTYPES[dtype]


TORCH_COMPILE_ENV = "RADIXSERVE_TORCH_COMPILE"


def default_torch_compile(device: torch.device) -> bool:
    """Compiled by default on CPU (``$RADIXSERVE_TORCH_COMPILE=0`` turns that off, as the test suite does);
    eager on CUDA, where the flashinfer kernels do the heavy work and a compile needs Triton."""
    return device.type == "cpu" and os.environ.get(TORCH_COMPILE_ENV, "1") != "0"


class ModelRunner:
    """Owns the model weights, the KV pool and the attention backend; runs one forward per scheduler step.

    Args:
        model_path: HF directory (config.json + safetensors, sharded or not) or a ``.gguf`` file.
        dtype: ``auto`` | ``float32`` | ``bfloat16`` | ``float16``.
        device: ``auto`` | ``cpu`` | ``cuda`` (``cuda:N``).
        attention_backend: ``auto`` | ``torch`` | ``flashinfer``.
        max_total_tokens: usable KV slots (wins over ``mem_fraction_static``).
        mem_fraction_static: fraction of the device's memory for weights + KV pool (SGLang's); default and rule in
            ``engine/memory/sizing.py`` (CUDA 0.9 of the GPU; CPU a 2 GiB pool within the memory limit).
        context_length: longest sequence (RoPE table size); default the model's ``max_position_embeddings``.
        num_threads: ``torch.set_num_threads`` when given.
        cpu_omp_threads_bind: ``auto`` | ``nobind`` | a CPU list: pin the OpenMP threads (``engine/cpu_threads.py``;
            CPU only). Call the constructor on the thread that runs the engine's torch ops.
        deterministic: batch-invariant logits (``--enable-deterministic-inference``): batch-invariant projections and
            LM head (``model/batch_invariant.py``) and the torch backend's deterministic attention.
        torch_compile: run the decoder layers through ``CompiledLayers`` (``compile.py``); graphs compile at
            ``warmup``.
            ``None``: ``default_torch_compile`` (on for CPU unless ``$RADIXSERVE_TORCH_COMPILE`` is ``0``).
        torch_compile_max_bs: forwards of more sequences run eager (``None``: all compiled).
        torch_compile_cache_dir: compile artifacts (default ``compile_cache_dir()``).
        weight_prepack: prepack the projections and the LM head for oneDNN (``prepack.py``): ``None`` where it pays
            (``prepack_pays``: bfloat16 / float16 on CPU), True wherever supported (float32 too), False never.
        quantization: ``"gguf"``: a ``.gguf`` file's Q4_0 / Q4_1 / Q8_0 projections, embedding and LM head kept
            quantized (``model/quant/load.py``; CPU only); ``"none"``: dequantized to ``dtype``; ``None``: ``"gguf"``
            for a ``.gguf`` on CPU in bfloat16 whose types it can keep, else dequantized (``_load_gguf``).
        torchao_config: ``"int8wo"`` or ``"int4wo-G"``: the projections of a dense checkpoint quantized at load
            (``model/quant/on_load.py``; CPU only); not with ``quantization``.

    Raises:
        ValueError: unsupported architecture / dtype / device / backend, a ``context_length`` above the model's
            ``max_position_embeddings`` (``check_context_length``), a KV pool that cannot hold one context;
            FileNotFoundError: no weights. ``quantization="gguf"`` without a ``.gguf`` file, or off CPU, an unknown
            ``torchao_config``, one off CPU, or both flags: ValueError;
            a GGUF tensor of a type it cannot keep quantized: ``quant.gguf_file.UnsupportedGGUFType`` (a ValueError).
    """

    def __init__(
        self,
        model_path: str,
        dtype: str = "auto",
        device: str = "auto",
        attention_backend: str = "auto",
        max_total_tokens: int | None = None,
        context_length: int | None = None,
        num_threads: int | None = None,
        mem_fraction_static: float | None = None,
        cpu_omp_threads_bind: str = "nobind",
        deterministic: bool = False,
        torch_compile: bool | None = False,
        torch_compile_max_bs: int | None = None,
        torch_compile_cache_dir: str | None = None,
        weight_prepack: bool | None = None,
        quantization: str | None = None,
        torchao_config: str | None = None,
    ) -> None:
        if not os.path.exists(model_path):
            raise FileNotFoundError(model_path)
        if quantization not in (None, "gguf", "none"):
            raise ValueError(f"unknown quantization {quantization!r}; choose gguf or none")
        if quantization == "gguf" and not is_gguf_path(model_path):
            raise ValueError(f"quantization 'gguf' needs a .gguf model file, got {model_path}")
        weight_only = WeightOnlyConfig.parse(torchao_config) if torchao_config else None
        if weight_only is not None and quantization == "gguf":
            raise ValueError(
                f"--torchao-config {torchao_config} quantizes dense weights: not with --quantization gguf "
                "(--quantization none dequantizes a .gguf for it)"
            )
        self.device = resolve_device(device)
        self.cpu_binding = self._set_threads(num_threads, cpu_omp_threads_bind)
        self.dtype = resolve_dtype(dtype, self.device)
        if weight_only is not None:  # regression: on CUDA it was refused only after the weights had loaded
            check_weight_only_supported(weight_only, self.device, self.dtype)
        self.model_config = ModelConfig.from_pretrained(model_path, context_length)
        cfg = self.model_config
        check_context_length(context_length, cfg.max_position_embeddings)  # before minutes of loading
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.model = LlamaForCausalLM(cfg, self.dtype, device="meta")
            loaded, quantization = self._load_gguf(model_path, quantization, torchao_config is not None)
            if not loaded:
                self.model.materialize(self.device, self.dtype)
                load_weights(self.model, model_path)
                if weight_only is not None:
                    quantize_projections(self.model, weight_only)
        self.quantization = quantization or torchao_config
        self.model.eval()
        self.model.set_batch_invariant(deterministic)
        self.prepacked = weight_prepack is not False and self.model.prepack(force=weight_prepack is True)
        self.load_seconds = time.perf_counter() - t0
        logger.info(
            "loaded %s (%s, %s) on %s in %.1f s%s%s%s",
            model_path,
            cfg.architecture,
            self.dtype,
            self.device,
            self.load_seconds,
            f", weights quantized ({self.quantization})" if self.quantization else "",
            ", weights prepacked for oneDNN" if self.prepacked else "",
            ", deterministic inference (batch-invariant GEMMs)" if deterministic else "",
        )
        if max_total_tokens is not None and max_total_tokens < 1:
            raise ValueError(f"max_total_tokens must be >= 1, got {max_total_tokens}")
        pool = self._size_kv_pool(max_total_tokens, mem_fraction_static)
        self.max_total_tokens = pool.tokens
        self.kv_pool_rule = pool.rule  # what sized the pool, in words (the engine's context-cut warning quotes it)
        self.kv_pool = KVPool(
            self.max_total_tokens + 1, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device
        )
        logger.info(
            "KV pool: %s, %s tokens at %s/token; sized by %s",
            format_bytes(self.kv_pool.total_bytes()),
            f"{self.max_total_tokens:,}",
            format_bytes(self.kv_pool.bytes_per_token()),
            pool.rule,
        )
        self.attn_backend = create_attention_backend(
            attention_backend,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            self.dtype,
            self.device,
            deterministic=deterministic,
        )
        self.compiled: CompiledLayers | None = None
        if torch_compile is None:
            torch_compile = default_torch_compile(self.device)
        if torch_compile:
            cache = configure_compile_cache(compile_cache_dir(torch_compile_cache_dir), torch.get_num_threads())
            self.compiled = CompiledLayers(torch_compile_max_bs)
            logger.info("torch.compile on (inductor, %d threads), cache %s", torch.get_num_threads(), cache)

    def _load_gguf(self, model_path: str, quantization: str | None, dense_asked: bool) -> tuple[bool, str | None]:
        """Load a ``.gguf`` kept quantized where asked (``"gguf"``) or by default. Returns ``(loaded, quantization)``:
        ``(False, None)`` when the caller must load dense weights; ``(True, "gguf")`` when some tensor stayed
        quantized; ``(True, None)`` for a file of F32 / F16 / BF16 tensors only, loaded dense here.

        The default (``quantization`` None) keeps a ``.gguf`` quantized on CPU in bfloat16, where the int4 kernel is
        vectorized, unless ``--torchao-config`` asks for dense weights; a file with a GGML type it cannot keep
        (``UnsupportedGGUFType``, found before anything is allocated) is then dequantized, with a warning naming the
        type. Elsewhere (CUDA, float32 / float16 on CPU) the default dequantizes, with an INFO line saying why.
        ``"gguf"`` raises what ``load_gguf_quantized`` raises; ``"none"`` always dequantizes.
        """
        if not is_gguf_path(model_path) or quantization == "none":
            return False, None
        if dense_asked:
            logger.info("%s dequantized: --torchao-config quantizes the dense weights", model_path)
            return False, None
        if quantization is None and (self.device.type != "cpu" or self.dtype != torch.bfloat16):
            logger.info(
                "%s dequantized to %s: GGUF weights stay quantized by default on CPU in bfloat16 only",
                model_path,
                str(self.dtype).removeprefix("torch."),
            )
            return False, None
        try:
            kept = load_gguf_quantized(self.model, model_path, self.device, self.dtype)
        except UnsupportedGGUFType as e:
            if quantization == "gguf":
                raise
            self.model = LlamaForCausalLM(self.model_config, self.dtype, device="meta")  # undo any module swaps
            logger.warning("%s; dequantized to %s instead", e, str(self.dtype).removeprefix("torch."))
            return False, None
        return True, "gguf" if kept else None  # regression: an all-F16 file reported quantization gguf

    def _set_threads(self, num_threads: int | None, bind: str) -> dict[int, int]:
        """``torch.set_num_threads`` and, on CPU, the OpenMP pinning; ``{thread id: cpu}`` of what was pinned."""
        threads = num_threads or torch.get_num_threads()
        cpus = resolve_bind(bind, threads) if self.device.type == "cpu" else None
        if cpus is None:
            torch.set_num_threads(threads)
            return {}
        placement = bind_omp_threads(cpus)
        if placement:
            logger.info("OpenMP threads pinned (thread -> cpu): %s", placement)
        return placement

    def weight_bytes(self) -> int:
        """Bytes of the loaded parameters and buffers (a tied embedding counted once)."""
        tensors = itertools.chain(self.model.parameters(), self.model.buffers())
        return sum(t.numel() * t.element_size() for t in tensors) + self.model.packed_bytes()

    def memory_summary(self) -> str:
        """``weights 210 MiB (int4wo-32), KV pool 2.0 GiB, RSS 2.6 GiB``: for the start-up log line (RSS: this
        process's resident memory, which also holds torch, the tokenizer and compiled kernels; CPU only)."""
        rss = process_rss_bytes() if self.device.type == "cpu" else None
        return ", ".join(
            [
                f"weights {format_bytes(self.weight_bytes())}"
                + (f" ({self.quantization})" if self.quantization else ""),
                f"KV pool {format_bytes(self.kv_pool.total_bytes())}",
            ]
            + ([f"RSS {format_bytes(rss)}"] if rss is not None else [])
        )

    def _size_kv_pool(self, max_total_tokens: int | None, mem_fraction_static: float | None) -> PoolSize:
        """The pool from the flags and the memory after the load (``size_kv_pool``; raises its ValueError)."""
        cfg = self.model_config
        if self.device.type == "cuda":
            free, memory = torch.cuda.mem_get_info(self.device)
            used = memory - free
        else:
            memory, used = memory_limit_bytes(), self.weight_bytes()
        return size_kv_pool(
            bytes_per_token=KVPool.bytes_per_token_for(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype),
            context_length=cfg.context_length,
            device_type=self.device.type,
            memory_bytes=memory,
            used_bytes=used,
            max_total_tokens=max_total_tokens,
            mem_fraction_static=mem_fraction_static,
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run one forward; float32 logits ``[batch_size, vocab]`` of each sequence's last new token.

        Writes the new tokens' K/V into ``kv_pool`` at ``batch.out_cache_loc`` as a side effect.
        """
        return self.model.compute_logits(self._hidden_states(batch, batch.logits_indices()))

    @torch.inference_mode()
    def forward_with_input_logprobs(
        self, batch: ForwardBatch, query: InputLogprobQuery
    ) -> tuple[torch.Tensor, InputLogprobs]:
        """``forward`` that also scores prompt tokens: the logits of ``batch`` as ``forward`` returns them, and
        the logprobs of ``query.targets`` at rows ``query.rows`` of the new tokens (``model/logits.py``, a bounded
        number of rows at a time). One pass through the layers serves both. ``batch`` is an EXTEND batch."""
        last = batch.logits_indices()
        rows = torch.cat([last, query.rows.to(last.device)])
        hidden = self._hidden_states(batch, rows)
        n = batch.batch_size
        logits = self.model.compute_logits(hidden[:n])
        scores = score_hidden_states(hidden[n:], self.model.compute_logits, query.targets, query.top_k)
        return logits, scores

    def _hidden_states(self, batch: ForwardBatch, rows: torch.Tensor) -> torch.Tensor:
        """The layers over ``batch``'s new tokens (K/V written to the pool); final hidden states ``[len(rows),
        hidden_size]`` of ``rows`` (int64 row indices into ``batch.input_ids``)."""
        self.attn_backend.init_forward_metadata(batch)
        compiled = self.compiled
        run_layer = compiled if compiled is not None and compiled.uses_compiled(batch.batch_size) else None
        with forward_context(batch, self.kv_pool, self.attn_backend):
            hidden: torch.Tensor = self.model.hidden_states(batch.input_ids, batch.positions, rows, run_layer)
        return hidden

    def warmup(self) -> None:
        """Warm-up forwards written to the dummy slot 0 (no usable slot is touched); with ``torch_compile`` they
        compile every graph the engine will use, so no request waits for a compile. Then the memory the load and
        compile freed goes back to the OS (``release_freed_memory``). Logs the start-up split."""
        if self.compiled is None:
            first = self._timed_forwards([ForwardBatch.build(ForwardMode.EXTEND, [[0]], [[0]], device=self.device)])
            release_freed_memory()
            logger.info(
                "start-up: load %.1f s, compile 0.0 s, warm-up %.1f s (eager: torch.compile off); %s",
                self.load_seconds,
                first,
                self.memory_summary(),
            )
            return
        # the first batch compiles both layer graphs; the others check they serve decode and batch 1 unchanged
        batches = [
            ForwardBatch.build(ForwardMode.EXTEND, [[0, 0, 0]] * 2, [[0, 0, 0]] * 2, device=self.device),
            ForwardBatch.build(ForwardMode.DECODE, [[0]] * 2, [[0]] * 2, device=self.device),
            ForwardBatch.build(ForwardMode.DECODE, [[0]], [[0]], device=self.device),
        ]
        first = self._timed_forwards(batches)
        warm = self._timed_forwards(batches)  # compiled by now: what is left of the first pass is the compile
        release_freed_memory()
        logger.info(
            "start-up: load %.1f s, compile %.1f s, warm-up %.1f s; %s",
            self.load_seconds,
            max(0.0, first - warm),
            warm,
            self.memory_summary(),
        )

    def _timed_forwards(self, batches: list[ForwardBatch]) -> float:
        """Seconds to run ``batches`` one after another (device work included)."""
        t0 = time.perf_counter()
        for batch in batches:
            self.forward(batch)
        self._sync()
        return time.perf_counter() - t0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
