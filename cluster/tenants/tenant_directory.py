"""Which tenant an API key belongs to, from SHA-256 digests of the keys (keys are not kept).

Built from the configured tenants plus the tenants file; `TenantDirectory.load` reads every
api_keys_file too. Rebuilt whole on a reload, then swapped in (one assignment), so a request
sees the old directory or the new one, never half of each.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from splitserve.cluster.tenants.tenant_config import TenantConfig, check_unique_names
from splitserve.cluster.tenants.tenants_file import TenantsFileError, load_tenants_file

OPERATOR = "operator"


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class TenantDirectory:
    def __init__(self, tenants: list[TenantConfig], digests: dict[bytes, TenantConfig]):
        self.tenants = {t.name: t for t in tenants}
        self._by_digest = digests

    @classmethod
    def load(
        cls, configured: list[TenantConfig], tenants_file: str | None, operator_key: str | None = None
    ) -> TenantDirectory:
        """Raises TenantsFileError (naming the file and line) on a bad file, a missing keys
        file, or one key given to two tenants. operator_key (the deployment's api_key) becomes
        the tenant OPERATOR without limits: the Batch API runner's lines run under it."""
        tenants = list(configured)
        if tenants_file:
            tenants += load_tenants_file(tenants_file)
        if operator_key:
            tenants.append(TenantConfig(name=OPERATOR, api_keys=[operator_key]))
        try:
            check_unique_names(tenants)
        except ValueError as exc:
            raise TenantsFileError(str(exc)) from None
        digests: dict[bytes, TenantConfig] = {}
        for tenant in tenants:
            for key in tenant.api_keys + _read_keys_file(tenant):
                digest = key_digest(key)
                other = digests.get(digest)
                if other is not None and other.name != tenant.name:
                    raise TenantsFileError(f"one API key is given to both tenants {other.name!r} and {tenant.name!r}")
                digests[digest] = tenant
        return cls(tenants, digests)

    def lookup(self, key: str | None) -> TenantConfig | None:
        return None if not key else self._by_digest.get(key_digest(key))

    def __len__(self) -> int:
        return len(self.tenants)


def _read_keys_file(tenant: TenantConfig) -> list[str]:
    if not tenant.api_keys_file:
        return []
    try:
        lines = Path(tenant.api_keys_file).read_text().splitlines()
    except OSError as exc:
        raise TenantsFileError(
            f"tenant {tenant.name!r}: cannot read api_keys_file {tenant.api_keys_file}: {exc.strerror or exc}"
        ) from None
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def watched_files(configured: list[TenantConfig], tenants_file: str | None, directory: TenantDirectory | None):
    """The files whose change triggers a reload: the tenants file and every api_keys_file."""
    files = [tenants_file] if tenants_file else []
    tenants = directory.tenants.values() if directory is not None else configured
    files += [t.api_keys_file for t in tenants if t.api_keys_file]
    return files


def file_stamps(paths: list[str]) -> tuple:
    """(mtime_ns, size) of each path (None when missing): a change in any means reload."""
    stamps = []
    for path in paths:
        try:
            stat = os.stat(path)
            stamps.append((path, stat.st_mtime_ns, stat.st_size))
        except OSError:
            stamps.append((path, None, None))
    return tuple(stamps)
