"""Tenants at the router: the workers' ``--api-keys-file``, so routing sees what the workers cache.

A request's *scope* is the salt its KV lives under on the workers (common/tenants.py): its key's
tenant combined with its ``cache_salt``. The router keys everything cache-related on it: the
approximate tree (a scope's keys start with the scope's own prefix, so two scopes never share a
node), the exact view's page keys (salted ids, hicache/salt.py, the same keys the workers
publish) and session affinity (``scope + session_id``). A client's tenant key is passed on to
the worker as it came (the worker needs it to find the tenant); the router's ``api_key`` stays
the default tenant, replaced by ``worker_api_key`` when one is set.

:class:`BoundedMap` is the LRU map the router keeps its per-session state in (bounded memory,
with a count of what it dropped). Keys are compared in constant time (hmac.compare_digest).
Read-only after start-up, except BoundedMap (event-loop thread only).
"""

from __future__ import annotations

import hashlib
import hmac
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from common.tenants import Tenant, TenantTable, effective_salt, load_tenants
from hicache import salt

# routing keys of a salted scope start with one character of its own, from the supplementary private
# use planes (router/approx_tree.py's unscoped keys start with \x01 or \x02), then the scope's digest
_SCOPE_CHARS = (0xF0000, 0x10FFFD - 0xF0000)


class Tenancy:
    def __init__(self, api_key: str | None, keys_file: str | None) -> None:
        self.expected = None if api_key is None else api_key.encode()
        self.table: TenantTable | None = load_tenants(keys_file) if keys_file else None

    @property
    def enforced(self) -> bool:
        return self.expected is not None or self.table is not None

    def authenticate(self, authorization: str, x_api_key: str = "") -> tuple[bool, Tenant | None]:
        """(allowed, tenant): the Bearer token (or, without an Authorization header, Anthropic's
        ``x-api-key``) is the router's key (default tenant) or a tenant's."""
        caller = self.identify(authorization, x_api_key)
        return caller.allowed, caller.tenant

    def identify(self, authorization: str, x_api_key: str = "") -> Caller:
        """Who sent the request: a tenant (its key is in the keys file), the admin (the key is the
        router's ``api_key``: it may administer the router, router/admin.py), or nobody known."""
        if authorization.strip():
            scheme, _, token = authorization.strip().partition(" ")
            raw = token.strip().encode() if scheme.lower() == "bearer" else b""
        else:
            raw = x_api_key.strip().encode()
        if not raw:
            return Caller(False, None, False)
        admin = self.expected is not None and hmac.compare_digest(raw, self.expected)
        tenant = self.table.find(raw) if self.table is not None else None
        return Caller(admin or tenant is not None, tenant, admin)


@dataclass(frozen=True)
class Caller:
    allowed: bool
    tenant: Tenant | None
    admin: bool  # the router's api_key


def scope_of(tenant: Tenant | None, body: dict[str, Any]) -> str | None:
    s = body.get("cache_salt")
    return effective_salt(tenant, s if isinstance(s, str) and s else None)


def scope_prefix(scope: str | None) -> str:
    """The routing-key prefix of a scope ('' for the unsalted default)."""
    if scope is None:
        return ""
    digest = hashlib.blake2b(scope.encode(), digest_size=8).digest()
    first = chr(_SCOPE_CHARS[0] + int.from_bytes(digest[:4], "little") % _SCOPE_CHARS[1])
    return first + digest[4:].hex()


def salted_ids(ids: list[int] | None, scope: str | None) -> list[int] | None:
    return ids if ids is None or scope is None else salt.apply(ids, salt.salt_tags(scope))


def session_key(scope: str | None, sid: str | None) -> str | None:
    return sid if sid is None or scope is None else f"{scope_prefix(scope)}|{sid}"


class BoundedMap(OrderedDict):
    """A dict that keeps its ``cap`` most recently set or read entries; ``evicted`` counts the rest."""

    def __init__(self, cap: int) -> None:
        super().__init__()
        self.cap = cap
        self.evicted = 0

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.cap:
            self.popitem(last=False)
            self.evicted += 1

    def get(self, key: Any, default: Any = None) -> Any:
        if key in self:
            self.move_to_end(key)
            return super().__getitem__(key)
        return default
