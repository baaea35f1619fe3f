"""The lease of a stored run: one writer per run's place in a store (`STORAGE/RUN_NAME/lease.json`).

A coordinator that writes a run with `train.storage` (`marsi run`, `marsi resume`, `Coordinator`) holds its lease:
an object naming this process (a random token, host, pid and the pid's start time, user, since when) and a
heartbeat, the time it last renewed it. It is taken with a create-if-absent (`agent_trainer/conditional.py`:
`O_EXCL` on a filesystem, `If-None-Match: *` on S3), renewed every `HEARTBEAT_S` seconds by a thread and at every
checkpoint with a replace-if-unchanged, checked before a checkpoint is written and again before it is committed,
and deleted when the coordinator closes. A second writer is refused in one line naming the holder (`LeaseHeld`).

A lease whose holder is gone is taken over: at once when the holder ran on this machine and its process is gone
(same host, boot and pid namespace; pid absent or started at another time); with `--take-over` (`take_over=True`) when its
heartbeat is older than `STALE_S` seconds (a holder on another machine cannot be asked; clocks are assumed to agree
within a minute). The take-over is itself a replace-if-unchanged, so of two machines taking over one lease one
wins. A holder whose lease was taken over finds out at its next heartbeat or checkpoint and stops (`LeaseLost`)
without writing to the store again.
"""

from __future__ import annotations

import getpass
import json
import math
import os
import secrets
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace

from agent_trainer import conditional
from protocols.errors import UserError
from protocols.messages import Location

LEASE = "lease.json"
HEARTBEAT_S = 30.0
"""Seconds between two renewals of a held lease."""
STALE_S = 300.0
"""A lease not renewed for this long may be taken over (`--take-over`)."""


class LeaseHeld(UserError, RuntimeError):
    """Another live marsi holds the run's lease."""


class LeaseLost(UserError, RuntimeError):
    """This run's lease was taken over (or removed) while it ran."""


@dataclass(frozen=True)
class Owner:
    """Who holds a lease, and when it last said so."""

    token: str
    host: str
    pid: int
    started: str | None
    """The process's start time (Linux: clock ticks since boot, from /proc/PID/stat), so a reused pid is told apart."""
    boot: str | None
    """This boot of the host and the process's pid namespace (Linux: /proc/sys/kernel/random/boot_id, /proc/self/ns/pid)."""
    user: str
    since: float
    heartbeat: float

    @classmethod
    def me(cls) -> Owner:
        now = time.time()
        return cls(token=secrets.token_hex(16), host=socket.gethostname(), pid=os.getpid(),
                   started=_start_time(os.getpid()), boot=_boot_id(), user=_user(), since=now, heartbeat=now)

    @classmethod
    def parse(cls, data: bytes) -> Owner | None:
        """The holder a lease object names; None when it is not one (a store shared with others may hold anything)."""
        try:
            raw = json.loads(data)
            optional = {k: None if raw[k] is None else str(raw[k]) for k in ("started", "boot")}
            owner = cls(token=str(raw["token"]), host=str(raw["host"]), pid=int(raw["pid"]), user=str(raw["user"]),
                        since=float(raw["since"]), heartbeat=float(raw["heartbeat"]), **optional)
        except (ValueError, TypeError, KeyError, OverflowError):
            return None
        return owner if math.isfinite(owner.since) and math.isfinite(owner.heartbeat) else None

    def encode(self) -> bytes:
        return (json.dumps(asdict(self), sort_keys=True) + "\n").encode()

    def age(self) -> float:
        return max(0.0, time.time() - self.heartbeat)

    def gone(self) -> bool:
        """Whether this holder ran on this machine, in this boot, and its process is gone."""
        if self.host != socket.gethostname() or self.boot is None or self.boot != _boot_id():
            return False
        return _start_time(self.pid) != self.started

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since))
        return f"pid {self.pid} on {self.host}, user {self.user}, since {since}; last heartbeat {self.age():.0f} s ago"


def held_by_other(place: Location, *, take_over: bool) -> None:
    """Refuse (LeaseHeld) when the lease of the run at `place` is held by a live marsi that this one may not take it
    from; nothing is written. What a resume checks before it fetches or changes anything."""
    found = conditional.read(place / LEASE)
    if found is None:
        return
    owner = Owner.parse(found[0])
    if owner is not None and not _may_take(owner, take_over):
        raise LeaseHeld(_held_message(place, owner))


class Lease:
    """This process's lease of the run at `place`: `take`, then `confirm` before each write of a checkpoint, and
    `release` at the end; a thread renews it meanwhile."""

    def __init__(self, place: Location):
        self.place, self.where = place, place / LEASE
        self.owner = Owner.me()
        self.version: str | None = None  # of the lease object as this process last wrote it; None: not held
        self.lost: str | None = None  # why it is no longer held: the message of LeaseLost
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> bool:
        return self.version is not None and self.lost is None

    def take(self, *, take_over: bool = False) -> None:
        """Create the lease, or take over one whose holder is gone (see the module); LeaseHeld otherwise."""
        data = self.owner.encode()
        if not conditional.atomic(self.where):
            fix = " (pip install 'marsi[s3]' installs boto3, whose conditional puts make it atomic)" \
                if self.where.root.startswith("s3:") else ""
            print(f"marsi: the lease of {self.place} is written and read back, not taken atomically{fix}; the check "
                  "before the first checkpoint stops a second writer", file=sys.stderr, flush=True)
        while not conditional.create(self.where, data):
            found = conditional.read(self.where)
            if found is None:
                continue  # released meanwhile: create it again
            owner = Owner.parse(found[0])
            if owner is not None and not _may_take(owner, take_over):
                raise LeaseHeld(_held_message(self.place, owner))
            if conditional.replace(self.where, data, found[1]):
                why = "its lease was unreadable" if owner is None else (
                    "that process is gone" if owner.gone() else f"no heartbeat for over {STALE_S:.0f} s")
                held = "" if owner is None else f" from {owner.describe()}"
                print(f"marsi: took over the lease of {self.place}{held}: {why}", file=sys.stderr, flush=True)
                break
        self.version = _version(self.where, data)
        self._thread = threading.Thread(target=self._beat, name="marsi-lease", daemon=True)
        self._thread.start()

    def confirm(self) -> None:
        """Renew the lease now, or raise LeaseLost if another marsi holds it (or it was removed)."""
        with self._lock:
            if self.lost is None:
                self._renew()
        if self.lost is not None:
            raise LeaseLost(self.lost)

    def release(self) -> None:
        """Stop renewing and delete the lease if this process still holds it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            if self.held:
                try:
                    conditional.delete(self.where, self.version)
                except OSError:
                    pass  # an unreachable store: the lease goes stale and is taken over
            self.version = None

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with self._lock:
                if self.lost is not None or self.version is None:
                    return
                try:
                    self._renew()
                except Exception:  # an unreachable store: tried again at the next beat or checkpoint
                    pass

    def _renew(self) -> None:
        """Write a new heartbeat over this process's lease (held under `_lock`); sets `lost` if it is not ours."""
        beat = replace(self.owner, heartbeat=time.time())
        if conditional.replace(self.where, beat.encode(), self.version):
            self.owner, self.version = beat, _version(self.where, beat.encode())
            return
        found = conditional.read(self.where)
        holder = Owner.parse(found[0]) if found is not None else None
        if holder is not None and holder.token == self.owner.token:  # ours, written by a renewal that timed out
            self.version = found[1]
            return
        now = "it was removed from the store" if found is None else (
            f"another marsi holds it ({holder.describe()})" if holder is not None else "it was overwritten")
        self.lost = (f"train.storage: {self.place}: this run no longer holds the run's lease: {now}; it stops without "
                     "writing to the store again (its steps since the last checkpoint stay in its run directory only); "
                     "find out who runs it before going on")


def _may_take(owner: Owner, take_over: bool) -> bool:
    return owner.gone() or (take_over and owner.age() > STALE_S)


def _held_message(place: Location, owner: Owner) -> str:
    return (f"train.storage: {place} is held by another marsi ({owner.describe()}); one run writes there at a time: "
            f"wait for it to end or stop it; a lease with no heartbeat for {STALE_S:.0f} s is stale (its run died "
            "on another machine): take it over by adding --take-over")


def _version(where: Location, data: bytes) -> str:
    """The version of the lease just written with `data` (read back: S3 names it)."""
    found = conditional.read(where)
    return found[1] if found is not None and found[0] == data else ""


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _boot_id() -> str | None:
    """This boot of the machine and this process's pid namespace (two containers on one machine may share a host
    name and a boot, not their pids)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{f.read().strip()} {os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())
