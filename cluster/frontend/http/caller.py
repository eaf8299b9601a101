"""Who an HTTP request comes from: whether its key may pass the guard, which owner's Batch API
objects it sees, and which tenant a generation runs as.

A request from the network is its bearer token's: with tenants, the tenant that key belongs to
(the admin key may also read, cancel and delete every owner's batch objects, and load and
unload LoRA adapters, but runs nothing);
without tenants there is one owner, "", and the key (if any) is the deployment's api_key. A
batch line runs in process (cluster/batch/line_executor.py) with its batch's owner in the ASGI
scope under BATCH_OWNER_SCOPE_KEY, which no client can set: it then runs as that tenant,
admitted, limited and billed as the same request over HTTP would be, with no key at all.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from starlette.types import Scope

from splitserve.cluster.frontend.http.guard import bearer_token
from splitserve.cluster.tenants.tenant_refusal import TenantRefusal

BATCH_OWNER_SCOPE_KEY = "splitserve.batch_owner"
BATCH_API_PREFIXES = ("/v1/files", "/v1/batches")  # where the admin key is let in
LORA_ADMIN_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")  # the admin key's alone, with tenants


@dataclass(frozen=True)
class Caller:
    owner: str | None  # whose Batch API objects it sees; None: everyone's (the admin key)
    api_key: str | None  # the bearer token, if any
    batch_line: bool = False  # run in process for a batch of `owner`'s, not sent over the network

    @property
    def is_admin(self) -> bool:
        return self.owner is None


def _same(token: str | None, key: str | None) -> bool:
    if not token or not key:
        return False
    return hmac.compare_digest(token.encode(), key.encode())


class Callers:
    def __init__(self, api_key: str | None, tenants, admin_api_key: str | None):
        """tenants: the TenantGate (None without tenants)."""
        self.api_key, self.tenants, self.admin_api_key = api_key, tenants, admin_api_key

    def authorized(self, scope: Scope) -> bool:
        """RequestGuard's check on a protected path, before the body is read."""
        if scope.get(BATCH_OWNER_SCOPE_KEY) is not None:
            return True
        token = bearer_token(scope.get("headers", []))
        if self.tenants is None:
            return not self.api_key or _same(token, self.api_key)
        if self.tenants.directory.lookup(token) is not None:
            return True
        admin_paths = scope["path"].startswith(BATCH_API_PREFIXES) or scope["path"] in LORA_ADMIN_PATHS
        return admin_paths and _same(token, self.admin_api_key)

    def of(self, scope: Scope) -> Caller:
        owner = scope.get(BATCH_OWNER_SCOPE_KEY)
        if owner is not None:
            return Caller(owner, None, batch_line=True)
        token = bearer_token(scope.get("headers", []))
        if self.tenants is None:
            return Caller("", token)
        if _same(token, self.admin_api_key):
            return Caller(None, token)
        tenant = self.tenants.directory.lookup(token)
        if tenant is None:  # the guard let it in; a reload since has revoked it
            raise TenantRefusal.unknown_key()
        return Caller(tenant.name, token)
