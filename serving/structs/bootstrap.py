"""A PD request's bootstrap (SGLang's ``bootstrap_host`` / ``_port`` / ``_room``): where its prefill
server's bootstrap listens and which room it is. Checked by the HTTP side, carried by
``ipc.GenerateReq``, held by the request (``Req.pd``) on a decode server."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Bootstrap:
    host: str
    port: int
    room: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Bootstrap:
        return cls(**d)
