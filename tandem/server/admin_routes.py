"""/admin routes (registered only with --admin-key; the Guard checks that key on every /admin call)."""
from __future__ import annotations

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from tandem.errors import TandemError
from tandem.server.schemas import AdoptRequest, ApiError


def add_admin_routes(app: FastAPI, runtime) -> None:
    def control():
        if runtime.control is None:
            raise ApiError(400, "the served drafter has no swappable weights (serve with --drafter eagle)", code="no_drafter_control")
        return runtime.control

    async def call(fn, *args):
        try:
            return await run_in_threadpool(fn, *args)
        except TandemError as e:
            raise ApiError(400, str(e)) from e

    @app.get("/admin/drafter")
    async def drafter_status():
        return await call(control().status)

    @app.post("/admin/drafter/adopt")
    async def adopt(body: AdoptRequest):
        return await call(control().adopt, body.version)

    @app.post("/admin/drafter/rollback")
    async def rollback():
        return await call(control().rollback)

    @app.post("/admin/training/pause")
    async def pause():
        return {"paused": await call(control().pause_training)}

    @app.post("/admin/training/resume")
    async def resume():
        return {"resumed": await call(control().resume_training)}

    @app.post("/admin/checkpoint")
    async def checkpoint():
        return {"checkpoint": await call(control().checkpoint)}
