"""The tenant of the request being handled (common/tenants.py has the tenants, the keys file and
the salts)."""

from __future__ import annotations

import contextvars

from common.tenants import Tenant

# set by the API-key middleware (serving/server/app.py) for the request's task; None: default tenant
CURRENT: contextvars.ContextVar[Tenant | None] = contextvars.ContextVar("hicache_tenant", default=None)
