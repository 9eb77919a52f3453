"""The language's exceptions: every failure names the call in the program that caused it."""

from __future__ import annotations


class BackendError(RuntimeError):
    """A backend refused or could not serve a call (the server's message, or why it is unreachable)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class LangError(RuntimeError):
    """A call of an LLM program failed: ``call`` is the expression (``gen('answer')``), ``program``
    the decorated function's name, ``status`` the server's HTTP status where there was one."""

    def __init__(self, call: str, program: str, message: str, status: int | None = None) -> None:
        where = f"{call} in program {program!r}" if program else call
        super().__init__(f"{where}: {message}")
        self.call = call
        self.program = program
        self.status = status
