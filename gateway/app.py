"""The gateway's HTTP app: /health, /live, /v1/models and /metrics here, and each API's routes
from its package: chat and text completions (``gateway.completions``), the Responses API
(``gateway.responses``, run through the chat path), the Files and Batch APIs
(``gateway.batches``), embeddings (``gateway.embeddings``) and LoRA adapters
(``gateway.adapters``). The work is in ``gateway.service``.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from gateway import errors
from gateway import metrics as gateway_metrics
from gateway.adapters.routes import install_adapter_routes
from gateway.auth import AuthConfig, guard, require_admin
from gateway.batches.routes import install_batch_routes
from gateway.completions.routes import CompletionRoutes, chat_runner, install_completion_routes
from gateway.embeddings.routes import install_embedding_routes
from gateway.responses.routes import install_responses_routes
from gateway.service import Gateway
from mesh.procutil import settle_heap


def create_app(gateway: Gateway) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await gateway.start()
        settle_heap()  # tokenizers, templates, routes built: out of the collector's way
        yield
        await gateway.stop()

    app = FastAPI(title="pdmesh gateway", lifespan=lifespan)
    errors.install(app)
    app.state.gateway = gateway

    @app.get("/health")
    async def health():
        ready = [m for m in gateway.live_models() if gateway.decode_workers(m)]
        embed = gateway.embed_models()  # /v1/embeddings only
        if ready or embed:
            return {"status": "ok", "models": ready, "embed_models": embed}
        return JSONResponse({"status": "unavailable", "models": [], "embed_models": []}, status_code=503)

    @app.get("/live")
    async def live():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        now = int(time.time())
        data = [{"id": m, "object": "model", "created": now, "owned_by": "pdmesh", "root": m, "parent": None,
                 "max_model_len": gateway.max_model_len(m)} for m in gateway.served_models()]
        data += [{"id": a, "object": "model", "created": now, "owned_by": "pdmesh", "root": a, "parent": base,
                  "max_model_len": gateway.max_model_len(base)} for a, base in sorted(gateway.adapters().items())]
        return {"object": "list", "data": data}

    @app.get("/metrics")
    async def metrics():
        return Response(gateway_metrics.render(gateway.workers_metrics), media_type="text/plain; version=0.0.4")

    install_completion_routes(app, gateway)
    install_adapter_routes(app, gateway)
    install_responses_routes(app, gateway, chat_runner(gateway, "responses"))
    install_batch_routes(app, gateway)
    install_embedding_routes(app, gateway)
    _install_components(app)
    return app


def _install_components(app: FastAPI) -> None:
    """Move the body models' definitions where their references point."""
    original = app.openapi

    def openapi():
        if app.openapi_schema:
            return app.openapi_schema
        doc = original()
        components = doc.setdefault("components", {}).setdefault("schemas", {})
        for path in doc.get("paths", {}).values():
            for op in path.values():
                components.update(op.pop("x-components", {}))
        app.openapi_schema = doc
        return doc

    app.openapi = openapi


def asgi_app(gateway: Gateway, auth: AuthConfig | None = None):
    """What uvicorn serves: ``create_app``'s FastAPI app behind ``CompletionRoutes``, behind the
    API keys (``auth``) and the request body cap."""
    app = create_app(gateway)
    if auth is not None and auth.enabled:
        app.state.require_admin = require_admin  # adapter loading: admin keys only
    return guard(CompletionRoutes(app, gateway), gateway, auth)
