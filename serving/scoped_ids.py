"""Each tenant's own namespace for the ids its clients choose: session ids and request ids (rids).

Two tenants may use the same session id or rid independently; within a tenant the usual rules
hold (an open session id is a 409, a running rid a 400). The engine keys sessions and requests by
one string, so the HTTP process sends a client's id *scoped*: ``<len>:<tenant>|<id>`` (the tenant's
name length-prefixed, so no tenant's scoped ids are another's). Answers and error messages carry
the client's id (:func:`unscoped`), never another tenant's.

- Session ids (serving/server/context.py for the generation routes, admin_api.py for
  /open_session and /close_session): a keys-file tenant's is scoped (:func:`session_key`); the
  default tenant's (``--api-key``, or no key at all) stays as it is. A session id never holds
  ``|`` (serving/server/session_ids.py), so no plain id is a scoped one. A drain's report names
  each session by its client's id and its tenant (serving/cache/kv_drain.py).
- Rids (serving/server/context.py): every client-chosen rid, the default tenant's as
  ``0:|<rid>``, since a rid may hold any character. The rids the server makes itself (uuid hex,
  ``health-``, ``prefetch-``, ``warmup``) hold no ``:`` and stay as they are.
"""

from __future__ import annotations

import re

_PREFIX = re.compile(r"(\d{1,6}):")


def scoped(tenant: str | None, client_id: str) -> str:
    """``client_id`` in ``tenant``'s namespace (None: the default tenant's)."""
    t = tenant or ""
    return f"{len(t)}:{t}|{client_id}"


def session_key(tenant: str | None, session_id: str) -> str:
    """The engine's key of a tenant's session: scoped for a keys-file tenant, as it is for the
    default tenant."""
    return session_id if tenant is None else scoped(tenant, session_id)


def unscoped(engine_id: str) -> str:
    """The client's id of a scoped id; any other id as it is."""
    m = _PREFIX.match(engine_id)
    if m is None:
        return engine_id
    bar = m.end() + int(m.group(1))
    return engine_id[bar + 1:] if engine_id[bar:bar + 1] == "|" else engine_id
