"""An engine process for chaos tests: the real engine HTTP app (engine/server/http.py) serving a ``FakeEngine``
(tests/fake_engine.py) with the real tokenizer, on ``--port``, starting in ~2 s instead of the real model's ~20 s.

    python tests/fake_engine_server.py --port P [--model NAME] [--delay-s S]

``--delay-s``: seconds per generated token (``POST /fake_delay?s=S`` changes it: a slow engine). Every reply is up to
400 tokens long (``max_tokens`` cuts it). ``--wait-for-port``: start up, log ``waiting for port P``, then listen as
soon as the port is free (a restart with the downtime of an exit, not of a start-up). ``GET /fake_stats`` answers
what it received: ``{"requests": [rid, ...], "aborted": [rid, ...], "running": [rid, ...]}`` (``aborted``: requests
whose client left before they finished, the router included). Logs ``serving NAME on URL`` once listening; SIGTERM
shuts it down (``/health`` answers 503 at once, requests in flight get up to 2 s to finish) without the real
engine's drain (``engine/server/drain.py``: the draining header, a 503 for new requests, ``--shutdown-timeout``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from radixserve.contracts.serving import BindError, bind_listen_sockets, serve  # noqa: E402
from radixserve.engine.server.http import create_app  # noqa: E402

from fake_engine import FakeEngine, load_tokenizer  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--delay-s", type=float, default=0.0)
    parser.add_argument("--wait-for-port", action="store_true", help="start up, then wait until --port is free")
    ns = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    engine = FakeEngine(load_tokenizer(), delay_s=ns.delay_s)
    engine.served_model_name = ns.model
    engine.set_outputs(["one two three four five six seven eight nine ten " * 40])
    app = create_app(engine)  # type: ignore[arg-type]

    @app.get("/fake_stats")
    async def fake_stats() -> dict[str, list[str]]:
        return {
            "requests": [r.rid for r in engine.requests],
            "aborted": list(engine.aborted),
            "running": sorted(engine.running),
        }

    @app.post("/fake_delay")
    async def fake_delay(s: float) -> dict[str, float]:
        engine.delay_s = s
        return {"delay_s": s}

    sockets = None
    if ns.wait_for_port:  # a restart prepared while the old process still serves: listen as soon as it is gone
        log = logging.getLogger("fake_engine_server")
        log.info("waiting for port %d", ns.port)
        while sockets is None:
            try:
                sockets = bind_listen_sockets("127.0.0.1", ns.port)
            except BindError:
                time.sleep(0.02)

    def log_serving(url: str) -> None:
        logging.getLogger("fake_engine_server").info("serving %s on %s", ns.model, url)

    return serve(
        app,
        "127.0.0.1",
        ns.port,
        "warning",
        sockets=sockets,
        on_listening=log_serving,
        on_exit=engine.shutdown,
        access_log=False,
        timeout_graceful_shutdown=2,
    )


if __name__ == "__main__":
    sys.exit(main())
