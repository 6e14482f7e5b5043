"""Where collectors find the learner ranks: a small key-value directory on a c10d ``TCPStore``.

Learner rank 0 hosts it at the address the user gives (``RemoteCollectors(address="HOST:PORT")``,
``python -m fabric_learner.collect --connect HOST:PORT``); every other learner rank and every
collector is a client. It carries no tensors, only who serves whom::

    <run>/world                          learner ranks of the run
    <run>/assign                         counter: the next collector's turn (rank = turn % world)
    <run>/rank<r>/connected              counter: collectors that took a turn serving rank r
    <run>/rank<r>/epochs                 counter: rank r's driver builds, one per (re)build
    <run>/rank<r>/e<e>/join              counter: collectors that joined build e (their slot), nodes imported
    <run>/rank<r>/e<e>/up                seconds build e's driver took to start (before its group)
    <run>/rank<r>/e<e>/group             "HOST PORT NODES": where build e's torchrl group meets
    <run>/rank<r>/e<e>/beat<slot>        counter: the collector in that slot is alive (its supervisor beats)
    <run>/rank<r>/e<e>/fault             set by a collector whose node died during build e, or by the driver
                                         when a collector stopped beating
    <run>/rank<r>/done                   set when rank r's collection has ended for good
    <run>/rank<r>/failed                 why rank r ended the run (every rank raises it)
    <run>/rank<r>/told                   rank r has said why the run ends (the first waits for all, briefly)

``<run>`` is a fresh identifier written under ``run`` each time learner rank 0 starts, so a
collector that outlives a learner restart (``torchrun --max-restarts``) sees the new run and
joins it instead of waiting on a group that no longer exists.
"""

from __future__ import annotations

import time
import uuid
from datetime import timedelta

from torch.distributed import TCPStore

RUN_KEY = "run"


def split_address(address: str) -> tuple[str, int]:
    """``"HOST:PORT"`` as ``(host, port)``, or an error naming the expected form."""
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"A collector directory address must be 'HOST:PORT' (for instance '127.0.0.1:29700'), got {address!r}.")
    return host, int(port)


class Directory:
    """One client (or, on learner rank 0, the host) of the collector directory."""

    def __init__(self, store: TCPStore, run: str) -> None:
        self.store = store
        self.run = run

    @classmethod
    def host(cls, address: str, world: int) -> Directory:
        """Serve the directory at ``address`` for a run of ``world`` learner ranks (learner rank 0)."""
        host, port = split_address(address)
        return cls.serve(TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)),
                         world)

    @classmethod
    def serve(cls, store: TCPStore, world: int) -> Directory:
        """Serve the directory on ``store``, a TCP store this process hosts (one bound to port 0: no pick-then-bind)."""
        run = uuid.uuid4().hex[:12]
        store.set(f"{run}/world", str(world))
        store.set(RUN_KEY, run)  # last: a client that reads the run finds its world
        return cls(store, run)

    @classmethod
    def connect(cls, address: str, timeout_s: float = 60.0) -> Directory:
        """A client of the directory at ``address``, once it is served and names a run."""
        host, port = split_address(address)
        store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        return cls(store, store.get(RUN_KEY).decode())

    def current_run(self) -> str:
        return self.store.get(RUN_KEY).decode()

    def key(self, *parts: object) -> str:
        return "/".join([self.run, *map(str, parts)])

    def world(self) -> int:
        return int(self.store.get(self.key("world")))

    def count(self, *parts: object, add: int = 0) -> int:
        return int(self.store.add(self.key(*parts), add))

    def has(self, *parts: object) -> bool:
        return self.store.check([self.key(*parts)])

    def wait_for(self, *parts: object, timeout_s: float, poll_s: float = 0.05, alive=lambda: True) -> bytes | None:
        """The value at ``parts`` once it is set, or ``None`` after ``timeout_s`` or when ``alive()`` turns false."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and alive():
            if self.has(*parts):
                return self.store.get(self.key(*parts))
            time.sleep(poll_s)
        return None
