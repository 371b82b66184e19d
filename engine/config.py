"""Engine configuration: one dataclass with defaults that run on a laptop; CLI flags follow SGLang's names."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from radixserve import constants


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
    max_running_requests: int = 64
    max_queued_requests: int = 256
    max_prefill_tokens: int = 4096
    chunked_prefill_size: int = 1024
    schedule_policy: str = "lpm"  # lpm | fcfs
    disable_radix_cache: bool = False
    attention_backend: str = "auto"  # auto | torch | flashinfer
    num_threads: int | None = None  # torch intra-op threads (CPU)
    stream_interval: int = 1  # tokens between streamed chunks
    max_request_body_bytes: int = 8 * 1024 * 1024
    api_key: str | None = None
    log_level: str = "info"
    warmup: bool = True
    # JSON object of sampling defaults for fields a request leaves unset (SGLang's --preferred-sampling-params),
    # e.g. '{"temperature": 0.2, "top_p": 0.9}' as the SmolLM2 model card recommends.
    preferred_sampling_params: str | None = None


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add every ``EngineArgs`` field as a ``--kebab-case`` flag."""
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(flag, action="store_true", default=f.default)
        else:
            typ = int if "int" in str(f.type) else str
            parser.add_argument(flag, type=typ, default=f.default)


def engine_args_from_namespace(ns: argparse.Namespace) -> EngineArgs:
    """Build ``EngineArgs`` from parsed flags."""
    return EngineArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)})
