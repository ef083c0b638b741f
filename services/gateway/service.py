"""`zeroserve gateway`: the OpenAI-compatible HTTP API on uvicorn, one AsyncClient to the scheduler.

Several gateways may serve one cluster (each is just another client of the scheduler)."""

from __future__ import annotations

import signal
import sys

from zeroserve.common.config import GatewayArgs, from_cli_args
from zeroserve.common.log import get_logger, setup_logging
from zeroserve.common.priority import set_nice

log = get_logger("gateway")


def main(args) -> int:
    setup_logging(service="gateway")
    cfg = from_cli_args(GatewayArgs, args)
    return serve(cfg)


def serve(cfg: GatewayArgs) -> int:
    import uvicorn

    try:
        set_nice(cfg.nice, "zeroserve gateway")
    except ValueError as e:
        print(e, file=sys.stderr, flush=True)
        return 1

    from zeroserve.services.gateway.app import create_app

    app = create_app(cfg)
    log.info("gateway starting", url=f"http://{cfg.host}:{cfg.port}", scheduler=cfg.scheduler,
             api_key=bool(cfg.api_key), tokenizer=cfg.models or None, nice=cfg.nice)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=5, lifespan="on")
    server = uvicorn.Server(config)
    # uvicorn stops gracefully on SIGTERM / SIGINT, then raises the signal again under the handlers
    # it found: make those no-ops, so a stopped gateway exits 0 (as the other services do)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    except OSError as e:
        print(f"zeroserve gateway: cannot serve on {cfg.host}:{cfg.port}: {e}", file=sys.stderr, flush=True)
        return 1
    return 0 if server.started else 1
