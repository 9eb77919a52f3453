"""Tenants from API keys (``--api-keys-file``), and the salt that isolates each tenant's cache.

The file is YAML::

    salt_secret: "a long random string"        # optional; see below
    keys:
      sk-alice-1: alice                        # key -> tenant
      sk-bob-1: {tenant: bob, quota_pages: {L1: 64, L2: 256, L3: 4096}}

A tenant may have several keys; its quota is given once (on any of its keys; two different
quotas for one tenant are an error). A request's tenant is the one its key names; the single
``--api-key`` (if any) is the default tenant (unsalted, no quota), as without this file.

A tenant's cache space is ``salt.combine(seed, cache_salt)`` with ``seed`` = HMAC-SHA256 of
the tenant's name under ``salt_secret`` (the name itself without a secret): a request can
subdivide its own tenant's space with ``cache_salt`` but never reach another tenant's, and
without the secret nobody can compute a tenant's L3 keys. Keys are compared in constant time
(``hmac.compare_digest`` against every key, no early exit).

Frozen and validated once at start-up; read-only afterwards (thread-safe). Shared by the
server (serving/server/tenants.py) and the router, which load the same file.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hicache import salt

TIERS = {"L1": "device", "L2": "host", "L3": "storage"}

@dataclass(frozen=True)
class Tenant:
    name: str
    seed: str  # what its cache space is salted with (never sent to clients)
    quota_pages: dict[str, int] = field(default_factory=dict)  # "device" | "host" | "storage" -> pages


@dataclass(frozen=True)
class TenantTable:
    keys: tuple[tuple[bytes, Tenant], ...]

    @property
    def tenants(self) -> dict[str, Tenant]:
        return {t.name: t for _, t in self.keys}

    def find(self, token: bytes) -> Tenant | None:
        """The tenant whose key is ``token`` (constant time in the token), None if none is."""
        found = None
        for key, tenant in self.keys:
            if hmac.compare_digest(token, key):
                found = tenant
        return found

    def quotas(self) -> dict[str, dict[str, int]]:
        """tenant -> {tier: pages} for tenants with a quota (what the engine enforces)."""
        return {t.name: dict(t.quota_pages) for t in self.tenants.values() if t.quota_pages}


def effective_salt(tenant: Tenant | None, request_salt: str | None) -> str | None:
    """The salt a request's KV is keyed under (None: the default tenant's unsalted space)."""
    return salt.combine(None if tenant is None else tenant.seed, request_salt)


def load_tenants(path: str | Path) -> TenantTable:
    """Read and validate ``--api-keys-file``; ValueError naming the problem."""
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"api_keys_file {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"api_keys_file {path}: not valid YAML: {e}") from None
    return parse_tenants(doc, str(path))


def parse_tenants(doc: Any, where: str = "api_keys_file") -> TenantTable:
    if not isinstance(doc, dict) or set(doc) - {"keys", "salt_secret"} or not isinstance(doc.get("keys"), dict):
        raise ValueError(f"{where}: expected a mapping with 'keys' (key -> tenant) and an optional 'salt_secret'")
    secret = doc.get("salt_secret")
    if secret is not None and (not isinstance(secret, str) or len(secret) < 16):
        raise ValueError(f"{where}: salt_secret must be a string of at least 16 characters")
    quotas: dict[str, dict[str, int]] = {}
    names: dict[str, str] = {}
    for key, entry in doc["keys"].items():
        if not isinstance(key, str) or len(key) < 8:
            raise ValueError(f"{where}: every API key must be a string of at least 8 characters")
        if isinstance(entry, str):
            entry = {"tenant": entry}
        if not isinstance(entry, dict) or set(entry) - {"tenant", "quota_pages"} or not isinstance(
                entry.get("tenant"), str) or not entry["tenant"]:
            raise ValueError(f"{where}: key {key[:4]}...: give a tenant name, or {{tenant: NAME, quota_pages: "
                             "{L1: N, L2: N, L3: N}}")
        name = entry["tenant"]
        names[key] = name
        q = entry.get("quota_pages")
        if q is None:
            continue
        if not isinstance(q, dict) or set(q) - set(TIERS) or not all(
                isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in q.values()):
            raise ValueError(f"{where}: tenant {name!r}: quota_pages maps L1 / L2 / L3 to positive page counts")
        q = {TIERS[k]: v for k, v in q.items()}
        if quotas.setdefault(name, q) != q:
            raise ValueError(f"{where}: tenant {name!r} has two different quotas")
    tenants = {}
    for name in set(names.values()):
        seed = name if secret is None else hmac.new(secret.encode(), name.encode(), hashlib.sha256).hexdigest()
        tenants[name] = Tenant(name, "tenant:" + seed, quotas.get(name, {}))
    return TenantTable(tuple((k.encode(), tenants[n]) for k, n in names.items()))
