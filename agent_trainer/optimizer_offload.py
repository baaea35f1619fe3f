"""`OptimizerOffload`: an optimizer's state (AdamW's moments and step counts) held in memory only around the
updates that use it. The schedule's plan (`orchestrator.memory_plan`) says, after each step, which agents update
at the next one; the others release their state, and an agent about to update fetches its own back in the
background during the step before, so its update does not wait.

- Released on CPU: every tensor's bytes written to a scratch file and the tensors dropped, so the process's
  resident memory falls (the trainer's process serves blocks of 1 MiB or more by their own mappings,
  `heap.return_freed_memory`; `heap.trim` returns the smaller ones). The file is a temporary file without a
  name (`tempfile.TemporaryFile`): it goes with the process, however the process ends. Its bytes are written and
  read by plain `write` / `readinto` calls, which let go of the GIL, so the trainer's own thread goes on
  meanwhile (`torch.save` / `torch.load` hold it for most of their work). The file stays a true copy until the
  next optimizer step, so a state fetched for a checkpoint and released again is not written twice.
- Released on a GPU: copied to pinned CPU memory and dropped from the GPU (its cached blocks emptied); fetched
  back on a side stream.
- Fetched: `prefetch()` has the background thread read the state back; `resident()` (before every update and every
  checkpoint) waits for it, or reads it now when nothing was prefetched, and puts the tensors back into the
  optimizer. Correctness never depends on the plan: an update or a checkpoint always finds the real state.
- A scratch file that cannot be written (a full disk, an unwritable temporary directory) keeps the state
  resident, said once on stderr: the release saves memory, it is never needed for the run to go on.
- A kill while released or fetching loses nothing a checkpoint holds: checkpoints are written from the resident
  state, and the scratch file is only a copy of the live one.

Every change of the optimizer's state (release, install) runs in the caller's thread or in the process's one
background thread (`_WORKER`, shared by the agents of the process, in the order asked), strictly one after
another; the trainer's own calls (`resident`) first wait for that thread's jobs of theirs.
"""

from __future__ import annotations

import contextlib
import queue
import sys
import tempfile
import threading
from typing import IO, Any, NamedTuple

import torch

from agent_trainer import heap

State = dict[int, dict[str, Any]]
"""Optimizer state by the index of its parameter in the optimizer's parameter groups."""


class Stored(NamedTuple):
    """Where a released CPU tensor is: its shape and dtype; its bytes follow the previous tensor's in the file."""

    shape: torch.Size
    dtype: torch.dtype


class _Worker:
    """The one background thread of a process for every optimizer's release and fetch, run in the order asked. The
    plan asks for the releases of a step before its fetches (`orchestrator.memory_plan`), so agents sharing a
    process hold one extra state at a time: a fetch starts once the release asked before it has freed its memory."""

    def __init__(self):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    def submit(self, job) -> threading.Event:
        """Queue `job` (which raises nothing); the event set once it has run."""
        done = threading.Event()
        with self.lock:
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="marsi-optimizer-offload", daemon=True)
                self.thread.start()
            self.jobs.put((job, done))
        return done

    def _run(self) -> None:
        while True:
            job, done = self.jobs.get()
            try:
                job()
            finally:
                done.set()


_WORKER = _Worker()


def wait_all() -> None:
    """Wait until this process's offload thread has run every job asked so far, whoever asked for it."""
    _WORKER.submit(lambda: None).wait()


class OptimizerOffload:
    """Release and fetch of one optimizer's state, on the device its parameters are on."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, device: torch.device, label: str):
        self.optimizer, self.device, self.label = optimizer, device, label
        self.released = False
        self.wanted = True  # the plan's last word: fetch (True) or release (False)
        self._copy: State | None = None  # GPU: the released state, in pinned CPU memory
        self._file: IO[bytes] | None = None  # CPU: the scratch file, its tensors' bytes one after another
        self._layout: dict[int, dict[str, Any]] = {}  # CPU: the released state, a `Stored` for each tensor
        self._copy_current = False  # the file (or pinned copy) equals the optimizer's state
        self._pending: threading.Event | None = None  # set when this optimizer's last background job is done
        self._fetched: State | None = None
        self._error: BaseException | None = None
        self.unwritable: str | None = None  # why the scratch file could not be written, once it could not

    # --------------------------------------------------------------------------------- the plan's calls
    def release(self) -> None:
        """Drop the state from memory, kept in the file (CPU) or in pinned CPU memory (GPU); in the background."""
        self.wanted = False
        self._after_pending(self._release)

    def prefetch(self) -> None:
        """Start reading a released state back, so that `resident()` finds it ready."""
        self.wanted = True
        if self.released or self._pending is not None:
            self._after_pending(self._read_ahead)

    # ----------------------------------------------------------------------------- the trainer's calls
    def resident(self) -> None:
        """Wait for the background work, then put a released state back into the optimizer."""
        self.wait()
        if not self.released:
            return
        fetched, self._fetched = self._fetched, None
        self._install(fetched if fetched is not None else self._read())

    @contextlib.contextmanager
    def held(self):
        """The state resident for a while (a checkpoint), and released again afterwards unless the plan has since
        asked for it back."""
        self.wait()
        again = self.released and not self.wanted
        self.resident()
        try:
            yield
        finally:
            if again:
                self.release()

    def changed(self) -> None:
        """The optimizer stepped: the file or pinned copy no longer holds its state."""
        self._copy_current = False

    def wait(self) -> None:
        """Wait for a release or a fetch under way; raise what it raised."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"agent {self.label!r}: releasing or fetching its optimizer state failed: "
                               f"{error}") from error

    def close(self) -> None:
        """Wait for the background work and close the scratch file (which removes it)."""
        try:
            self.wait()
        finally:
            if self._file is not None:
                self._file.close()
                self._file = None

    # ------------------------------------------------------------------------------------- internals
    def _after_pending(self, work) -> None:
        """Run `work` in the background, after every job asked before it in this process (`_WORKER`)."""

        def run() -> None:
            if self._error is not None:
                return
            try:
                work()
            except BaseException as exc:  # raised by the next `wait`, in the trainer's thread
                self._error = exc

        self._pending = _WORKER.submit(run)

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _release(self) -> None:
        if self.released:
            self._fetched = None  # a fetch the plan no longer wants
            return
        if self.unwritable is not None:
            return
        params = self._params()
        state: State = {i: self.optimizer.state[p] for i, p in enumerate(params) if p in self.optimizer.state}
        if not state:  # no step yet: nothing to release
            return
        if not self._copy_current:
            if self.device.type == "cuda":
                with torch.cuda.device(self.device):
                    self._copy = {i: {k: _pinned(v) for k, v in s.items()} for i, s in state.items()}
                    torch.cuda.current_stream(self.device).synchronize()
            else:
                try:
                    self._write(state)
                except OSError as exc:  # the state is untouched: it stays where it is
                    self._unwritable(exc)
                    return
            self._copy_current = True
        del state
        self.optimizer.state.clear()
        self.released = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            heap.trim()

    def _unwritable(self, exc: OSError) -> None:
        """The scratch file could not take the state: emptied, and the state kept resident from now on."""
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.truncate(0)
        if self.unwritable is None:
            print(f"marsi: agent {self.label!r}: its optimizer state stays in memory between updates: the scratch file "
                  f"could not be written ({exc.strerror or exc}); free space in {tempfile.gettempdir()} or set "
                  f"agents.{self.label}.optimizer.offload: off", file=sys.stderr, flush=True)
        self.unwritable = str(exc)

    def _read_ahead(self) -> None:
        if self.released and self._fetched is None:
            self._fetched = self._read()

    def _read(self) -> State:
        """The released state, on the optimizer's device."""
        if self.device.type != "cuda":
            return self._read_file()
        stream = torch.cuda.Stream(self.device)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            state = {i: {k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in s.items()}
                     for i, s in self._copy.items()}
        stream.synchronize()
        return state

    def _install(self, state: State) -> None:
        params = self._params()
        for i, s in state.items():
            if self.device.type == "cuda":  # copied on the side stream, used on the trainer's from now on
                for value in s.values():
                    if torch.is_tensor(value):
                        value.record_stream(torch.cuda.current_stream(self.device))
            self.optimizer.state[params[i]] = s
        self.released = False
        if self.device.type == "cuda":  # pinned memory is scarce: released again, the state is copied again
            self._copy, self._copy_current = None, False

    def _write(self, state: State) -> None:
        """The tensors' bytes into the scratch file, in order; their shapes and dtypes into `_layout`."""
        if self._file is None:
            self._file = tempfile.TemporaryFile(prefix=f"marsi-optimizer-{self.label}-", buffering=0)
        self._file.seek(0)
        self._file.truncate()
        self._layout = {}
        for i, s in state.items():
            self._layout[i] = {}
            for key, value in s.items():
                if torch.is_tensor(value):
                    value = value.detach().contiguous()
                    _write_all(self._file, _bytes(value))
                    value = Stored(value.shape, value.dtype)
                self._layout[i][key] = value

    def _read_file(self) -> State:
        """The state `_write` wrote, in new tensors."""
        self._file.seek(0)
        state: State = {}
        for i, entry in self._layout.items():
            state[i] = {}
            for key, value in entry.items():
                if isinstance(value, Stored):
                    tensor = torch.empty(value.shape, dtype=value.dtype)
                    _read_all(self._file, _bytes(tensor))
                    value = tensor
                state[i][key] = value
        return state


def _bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, shared with it."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _write_all(file: IO[bytes], data: memoryview) -> None:
    while len(data):
        data = data[file.write(data):]


def _read_all(file: IO[bytes], data: memoryview) -> None:
    while len(data):
        n = file.readinto(data)
        if not n:
            raise EOFError("the optimizer's scratch file ended early")
        data = data[n:]


def _pinned(value: Any) -> Any:
    """A CPU copy of a GPU tensor in pinned memory (copied asynchronously on the current stream)."""
    if not torch.is_tensor(value):
        return value
    copy = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=True)
    return copy.copy_(value, non_blocking=True)
