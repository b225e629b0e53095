"""The engines' KV-cache registrations, one per rank: who may make or replace one,
which one a worker holds, and the attaches in flight. Socket-free.

A registration is the engine's; a hostile or confused client must not be able to
take it away. So a registration replaces the one in place only when it
comes from the client that made that one, carries the token its registration
returned, or the engine that made it has exited (an engine restart). A
registration the worker cannot open leaves the working one in place (the worker
keeps it too), and only a registration a worker accepted is re-sent to a
restarted worker. A registration's depth and size are bounded when its request is
decoded (`tierkv.wire.protocol`), its fields checked here, before it is kept or
forwarded: it came over a socket.
"""

from __future__ import annotations

import itertools
import secrets
from dataclasses import dataclass
from typing import Any

from tierkv.core.shm import owner_alive

REQUIRED = ("version", "device", "layout", "tensors")


class RegistrationRefused(ValueError):
    """Why a registration is not accepted; becomes the client's error reply."""


def check_shape(registration: Any) -> None:
    """The fields every registration has (its depth and size were bounded when the
    request was decoded; the worker checks the rest when it opens it)."""
    if not isinstance(registration, dict):
        raise RegistrationRefused(
            f"a registration must be a map, got {type(registration).__name__}")
    missing = [k for k in REQUIRED if k not in registration]
    if missing:
        raise RegistrationRefused(f"a registration needs {', '.join(REQUIRED)}; "
                                  f"missing {', '.join(missing)}")


@dataclass
class _Owner:
    client: bytes
    token: str
    engine_pid: int  # the pid the registration names (0: unknown)


@dataclass(frozen=True)
class PendingAttach:
    client: bytes | None  # who made it (None: a re-attach after a worker restart)
    request_id: int | None  # the request to answer (None: nobody waits)
    rank: int
    registration: dict[str, Any]
    deadline: float
    token: str  # the right to use it (`AttachKV.token`)


class Registrations:
    def __init__(self) -> None:
        self.working: dict[int, dict[str, Any]] = {}  # rank -> what its worker holds
        self._owners: dict[int, _Owner] = {}
        self._waiting: dict[int, tuple[bytes, dict[str, Any]]] = {}  # rank without a worker
        self.pending: dict[int, PendingAttach] = {}  # reg id -> attach in flight
        self._ids = itertools.count(1)

    def check(self, client: bytes, rank: int, registration: Any, token: str) -> bool:
        """May `client` register this for `rank`? Raises RegistrationRefused. True
        when it is the same engine again (its client, or its token): the token, and
        with it the right of the clients it gave it to, stays."""
        check_shape(registration)
        owner = self._owners.get(rank)
        if owner is None:
            return False
        if owner.client == client or (token and secrets.compare_digest(token, owner.token)):
            return True
        if owner.engine_pid and not owner_alive(owner.engine_pid, 0):
            return False  # the engine that registered has exited: a restart may replace it
        raise RegistrationRefused(
            f"rank {rank}'s KV cache is registered by another engine (pid "
            f"{owner.engine_pid or '?'}): only that engine, or a client with the token its "
            "registration returned, may replace it")

    def wait_for_worker(self, client: bytes, rank: int, registration: dict[str, Any]) -> None:
        """No worker of `rank` yet: attach when one says hello (nobody waits)."""
        self._waiting[rank] = (client, registration)

    def begin(self, client: bytes | None, request_id: int | None, rank: int,
              registration: dict[str, Any], deadline: float,
              same_engine: bool = False) -> tuple[int, str]:
        """An attach to send: its id and the token that will prove the right to it
        (a re-attach, or the same engine registering again, keeps the one it has)."""
        reg_id = next(self._ids)
        owner = self._owners.get(rank)
        keep = owner is not None and (client is None or same_engine)
        token = owner.token if keep and owner is not None else secrets.token_hex(16)
        self.pending[reg_id] = PendingAttach(client, request_id, rank, registration, deadline,
                                             token)
        return reg_id, token

    def may_use(self, client: bytes, rank: int, tokens: list[str]) -> bool:
        """May `client` store from and load into rank's KV cache? Only the client
        that registered it, or one that shows the token its registration returned."""
        owner = self._owners.get(rank)
        if owner is None:
            return False
        if owner.client == client:
            return True
        given = tokens[rank] if rank < len(tokens) else ""
        return bool(given) and secrets.compare_digest(given, owner.token)

    def drop_client(self, client: bytes) -> list[tuple[int, str]]:
        """The client that registered these ranks ended: their registrations go.
        Returns (rank, token) of each, so its worker can be told which to let go of."""
        ended = [(rank, owner.token) for rank, owner in self._owners.items()
                 if owner.client == client]
        for rank, _ in ended:
            del self._owners[rank]
            self.working.pop(rank, None)
        for rank, (waiting, _) in list(self._waiting.items()):
            if waiting == client:
                del self._waiting[rank]
        return ended

    def for_new_worker(self, rank: int) -> tuple[bytes | None, dict[str, Any]] | None:
        """What a worker that just said hello should attach: a registration that
        waited for it, else the working one of an engine that is still alive."""
        waiting = self._waiting.pop(rank, None)
        if waiting is not None:
            return waiting
        registration = self.working.get(rank)
        if registration is None:
            return None
        pid = registration.get("pid")
        if type(pid) is int and pid > 0 and not owner_alive(pid, 0):
            # The engine exited: its memory is gone, nothing to re-attach.
            del self.working[rank]
            self._owners.pop(rank, None)
            return None
        return None, registration

    def adopt(self, rank: int, registration: dict[str, Any], token: str) -> None:
        """A worker kept this registration across a broker restart: the engine that
        made it proves its right with the token the worker kept beside it."""
        self.working.setdefault(rank, registration)
        if token and rank not in self._owners:
            pid = registration.get("pid")
            self._owners[rank] = _Owner(b"", token, pid if type(pid) is int and pid > 0 else 0)

    def attached(self, reg_id: int, ok: bool) -> tuple[PendingAttach | None, str]:
        """A worker's answer; returns the attach and, if it worked and a client
        made it, the token for replacing it later."""
        pending = self.pending.pop(reg_id, None)
        if pending is None or not ok:
            return pending, ""
        self.working[pending.rank] = pending.registration
        if pending.client is None:
            return pending, ""
        pid = pending.registration.get("pid")
        self._owners[pending.rank] = _Owner(pending.client, pending.token,
                                            pid if type(pid) is int and pid > 0 else 0)
        return pending, pending.token

    def overdue(self, now: float) -> list[PendingAttach]:
        late = [reg_id for reg_id, p in self.pending.items() if now > p.deadline]
        return [self.pending.pop(reg_id) for reg_id in late]
