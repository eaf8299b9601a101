"""The admin endpoints, behind `admin_api_key` (404 without one configured: they do not exist):

- GET /admin/usage?tenant=&start=&end= — settled usage per tenant and model summed over the
  UTC hours in [start, end) (epoch seconds; both optional), from the state store, so it covers
  every ingress replica (each writes within tenant_sync_s; this one first writes its own). A
  value out of range or malformed is a 400 naming the parameter.
- POST /admin/reload — re-reads the tenants file and keys files now: 200 with the tenant count,
  or 400 naming the file and line (the old tenants stay).
"""

from __future__ import annotations

import asyncio
import hmac

from fastapi import Depends, FastAPI, Query, Request
from fastapi.responses import JSONResponse

from splitserve.cluster.frontend.http.errors import OpenAIHTTPError
from splitserve.cluster.frontend.http.guard import bearer_token
from splitserve.cluster.tenants.tenants_file import TenantsFileError

# The last second of year 9999: any later "epoch second" is a client's mistake (and past it the
# store's 64-bit columns overflow).
MAX_EPOCH_S = 253_402_300_799


def add_admin_routes(app: FastAPI, gate, admin_api_key: str | None) -> None:
    def check_admin(request: Request) -> None:
        if not admin_api_key:
            raise OpenAIHTTPError(404, "the admin API is off (set admin_api_key)", code="not_found")
        token = bearer_token(request.scope.get("headers", []))
        if token is None or not hmac.compare_digest(token.encode(), admin_api_key.encode()):
            raise OpenAIHTTPError(
                401, "the admin endpoints need 'Authorization: Bearer <admin_api_key>'", code="invalid_api_key"
            )

    # A dependency, so who asks is checked before what is asked (a stranger gets 401, not 400).
    @app.get("/admin/usage", include_in_schema=False, dependencies=[Depends(check_admin)])
    async def usage(
        tenant: str | None = Query(None, min_length=1, max_length=64),
        start: int | None = Query(None, ge=0, le=MAX_EPOCH_S),
        end: int | None = Query(None, ge=0, le=MAX_EPOCH_S),
    ):
        if start is not None and end is not None and end <= start:
            raise OpenAIHTTPError(400, f"end ({end}) must be after start ({start})", param="end")
        await asyncio.to_thread(gate.meter.flush)
        rows = await asyncio.to_thread(gate.usage_store.query, tenant, start, end)
        return JSONResponse({"object": "list", "data": rows, "start": start, "end": end})

    @app.post("/admin/reload", include_in_schema=False, dependencies=[Depends(check_admin)])
    async def reload():
        try:
            await asyncio.to_thread(gate.reload)
        except TenantsFileError as exc:
            raise OpenAIHTTPError(400, f"tenants not reloaded, the previous ones stay: {exc}") from None
        return JSONResponse({"tenants": len(gate.directory)})
