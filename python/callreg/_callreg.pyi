"""The extension module under the package (``python/src/lib.rs``): a thin
front over the crate's Worker, its envelopes and hashids."""

from collections.abc import Callable
from typing import Final, Literal, TypedDict, final

__all__ = [
    "RawWorker",
    "RawHandle",
    "RawPending",
    "RawError",
    "encode_envelope",
    "envelope_hashid",
    "envelope_header",
    "_template_main",
    "VERSION",
    "DEFAULT_MAX_FRAME_BYTES",
]

VERSION: Final[str]
DEFAULT_MAX_FRAME_BYTES: Final[int]

class _ErrorFields(TypedDict):
    """``RawError.args[0]``: a failed operation's fields."""

    code: str
    operation: str
    target: int | None
    hashid: str | None
    seq: int | None
    message: str
    full: str
    kind: str
    exception: bytes | None
    outcomes: list[tuple[int, str]]

class RawError(Exception):
    """A failed operation: ``args[0]`` is its :class:`_ErrorFields`."""

@final
class RawHandle:
    @property
    def hashid(self) -> str: ...
    @property
    def digest(self) -> bytes: ...
    @property
    def namespace(self) -> str: ...
    @property
    def handle_id(self) -> int: ...

@final
class RawPending:
    @property
    def id(self) -> int: ...
    # (output, error) once done; 1: the time was up; 0: another thread
    # waits on it, or it was armed.
    def wait(self, timeout: float | None = None) -> tuple[bytes | None, _ErrorFields | None] | int: ...
    def is_complete(self) -> bool: ...

@final
class RawWorker:
    def __new__(
        cls,
        targets: int,
        control_timeout: float,
        slot_capacity: int,
        max_frame_bytes: int,
        target_initializer: Callable[[int], object] | None = None,
        operation_timeout: float | None = None,
        probe_first: bool = True,
        respawn_limit: int = ...,  # the crate's DEFAULT_RESPAWN_LIMIT (3)
        respawn_backoff: float = 0.1,
        template: tuple[str, list[str], bytes] | None = None,
    ) -> RawWorker: ...
    def register(self, envelope: bytes, metadata: str | None = None) -> RawHandle: ...
    def unregister(self, handle: RawHandle) -> None: ...
    def start(self) -> list[tuple[int, _ErrorFields]]: ...
    def submit(
        self, handle: RawHandle, target: int | None, input: bytes, timeout: float | None = None
    ) -> RawPending: ...
    def cancel(self, pending: RawPending) -> bool: ...
    def arm(self, pending: RawPending) -> bool: ...
    def call(self, handle: RawHandle, target: int | None, input: bytes, timeout: float | None = None) -> bytes: ...
    def next_completions(self, timeout: float) -> list[tuple[int, bytes | None, _ErrorFields | None]] | None: ...
    def forgive(self, hashid: str) -> bool: ...
    def live_targets(self) -> list[int]: ...
    def target_pid(self, target: int) -> int | None: ...
    def target_loss(self, target: int) -> str | None: ...
    def target_incarnation(self, target: int) -> int: ...
    def slot_phase(self, target: int) -> Literal["joined", "backing_off", "spawning", "joining", "lost"]: ...
    def slot_state(
        self, target: int
    ) -> tuple[Literal["joined", "backing_off", "spawning", "joining", "lost"], int]: ...
    def slot_events_json(self) -> str: ...
    def registry_json(self) -> str: ...
    def tables_json(self) -> str: ...
    def close(self) -> None: ...

def encode_envelope(payload: bytes) -> bytes: ...
def envelope_header(payload_size: int) -> bytes: ...
def envelope_hashid(envelope: bytes) -> str: ...
def _template_main(prepare: Callable[[bytes], Callable[[int], object] | None]) -> int:
    """The template process of a ``start_method="forkserver"`` Worker
    (``callreg._forkserver.main``): reads the setup the parent passed,
    calls ``prepare(runtime_data)`` (imports the preload modules, returns
    the target initializer), then forks every target until the parent
    closes; returns the exit status. When ``prepare`` raises, the parent's
    start fails with ``str()`` of its exception. Raises ``RuntimeError``
    in a process not started as a template."""
