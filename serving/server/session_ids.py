"""What a session id may look like, checked once at the HTTP edge (every route that takes one:
``/open_session``, ``/close_session`` and the ``session_id`` of every generation route).

An id is 1 to :data:`MAX_SESSION_ID_CHARS` characters of ``[A-Za-z0-9._:-]``: what SGLang
(uuid hex), vLLM-style clients and routers send, and nothing a log line, a header or a path can
be fooled by (no NUL, CR/LF, ``/`` or spaces). Anything else is a 400 naming the problem.
"""

from __future__ import annotations

import re

from serving.server.errors import APIError

MAX_SESSION_ID_CHARS = 256
_ALLOWED = re.compile(r"[A-Za-z0-9._:-]*")
_CHARS = "letters, digits and . _ : -"


def session_id_problem(sid: object) -> str | None:
    """Why ``sid`` is not a valid session id (None: it is)."""
    if not isinstance(sid, str):
        return "session_id must be a string"
    if not sid:
        return "session_id must not be empty"
    if len(sid) > MAX_SESSION_ID_CHARS:
        return f"session_id has {len(sid)} characters; at most {MAX_SESSION_ID_CHARS} are allowed"
    ok = _ALLOWED.match(sid)
    end = ok.end() if ok else 0
    if end < len(sid):
        return f"session_id may contain only {_CHARS} (found {sid[end]!r} at position {end})"
    return None


def check_session_id(sid: object, param: str = "session_id") -> None:
    """A 400 naming the problem unless ``sid`` is a valid session id."""
    problem = session_id_problem(sid)
    if problem is not None:
        raise APIError(400, problem, param=param)
