"""The tenant of the request being handled (hicache/tenants.py has the tenants, the keys file and
the salts)."""

from __future__ import annotations

import contextvars

from hicache.tenants import Tenant

# set by the API-key middleware (serving/server/app.py) for the request's task; None: default tenant
CURRENT: contextvars.ContextVar[Tenant | None] = contextvars.ContextVar("hicache_tenant", default=None)
