"""The ``radixserve`` console script (also ``python -m radixserve``).

``radixserve engine [flags]``   one engine (FastAPI + uvicorn) on --host/--port (default 127.0.0.1:30000).
``radixserve up [flags]``       the local stack; for now one engine with the demo model on 127.0.0.1:8000.
``radixserve router|operator``  not implemented yet (issues 3 and 5).

Engine flags are ``EngineArgs`` fields in ``--kebab-case`` (``radixserve.engine.config.add_engine_args``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from typing import Any
from pathlib import Path

from radixserve import constants

_REPO_ROOT = Path(__file__).resolve().parents[1]
_NOT_YET = {"router": 3, "operator": 5}  # subcommand -> the issue that builds it


def resolve_model_path(path: str) -> str:
    """``path`` as given if it exists; else, for a relative path, the same path under the repository root (so the
    demo model is found from any working directory); else ``path`` unchanged (the engine reports it)."""
    if os.path.exists(path) or os.path.isabs(path):
        return path
    candidate = _REPO_ROOT / path
    return str(candidate) if candidate.exists() else path


def build_parser() -> argparse.ArgumentParser:
    from radixserve.engine.config import add_engine_args

    parser = argparse.ArgumentParser(prog="radixserve", description="SGLang-style LLM serving")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{engine,up,router,operator}")
    p_engine = sub.add_parser("engine", help="run one engine (OpenAI-compatible HTTP server)")
    add_engine_args(p_engine)
    p_up = sub.add_parser("up", help=f"run the local stack on {constants.PUBLIC_HOST}:{constants.PUBLIC_PORT}")
    add_engine_args(p_up)
    # At OpenAI's default temperature 1.0 the 4-bit 135M demo model rambles (see DEMO_MODEL_SAMPLING_DEFAULTS);
    # requests that set temperature still get what they ask for.
    p_up.set_defaults(host=constants.PUBLIC_HOST, port=constants.PUBLIC_PORT, model_path=constants.DEMO_MODEL_DIR,
                      preferred_sampling_params=constants.DEMO_MODEL_SAMPLING_DEFAULTS)
    for name, issue in _NOT_YET.items():
        sub.add_parser(name, help=f"not implemented yet (issue {issue})")
    return parser


def run_engine(args: "EngineArgs") -> int:  # noqa: F821 - imported lazily (torch is slow to import)
    """Load the engine, serve it with uvicorn until Ctrl-C/SIGTERM (the app's lifespan shuts the engine down)."""
    import uvicorn

    from radixserve.engine.engine import Engine
    from radixserve.engine.server.http import create_app

    args.model_path = resolve_model_path(args.model_path)
    if args.tokenizer_path:
        args.tokenizer_path = resolve_model_path(args.tokenizer_path)
    if not args.served_model_name:
        args.served_model_name = os.path.basename(os.path.normpath(args.model_path)).removesuffix(".gguf").lower()
    log = logging.getLogger("radixserve")
    log.info("loading %s (served as %s)", args.model_path, args.served_model_name)
    engine = Engine(args)
    app = create_app(engine)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level.lower(), timeout_graceful_shutdown=5
    )
    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # Abort in-flight requests at once (clients get an OpenAI-format 503 or a stream error event) instead
            # of letting uvicorn wait out its graceful timeout and cancel handlers mid-response.
            threading.Thread(target=engine.shutdown, name="radixserve-shutdown", daemon=True).start()
            super().handle_exit(sig, frame)

    server = Server(config)
    log.info("serving %s on http://%s:%d", engine.served_model_name, args.host, args.port)
    server.run()
    return 0 if server.started else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``radixserve`` console script; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in _NOT_YET:  # before parsing: their future flags are unknown here
        print(f"radixserve {argv[0]}: not implemented yet (issue {_NOT_YET[argv[0]]})", file=sys.stderr)
        return 2
    ns = build_parser().parse_args(argv)
    from radixserve.engine.config import engine_args_from_namespace

    args = engine_args_from_namespace(ns)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        return run_engine(args)
    except KeyboardInterrupt:  # Ctrl-C while the model was still loading
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
