import concurrent.futures
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Final, Generic, NoReturn, ParamSpec, TypeVar

_T = TypeVar("_T")
_R = TypeVar("_R")
_P = ParamSpec("_P")

__all__ = [
    "Executor",
    "Worker",
    "NextLevel",
    "Context",
    "context",
    "Handle",
    "pack",
    "hashid",
    "CallregError",
    "RegisterError",
    "HandleError",
    "TargetLostError",
    "LifecycleError",
    "EnvelopeError",
    "TaskError",
    "RemoteTraceback",
    "DEFAULT_MAX_FRAME_BYTES",
]

__version__: Final[str]
DEFAULT_MAX_FRAME_BYTES: Final[int]
KIND: Final[str]
NAMESPACE: Final[str]

class CallregError(Exception):
    code: str
    operation: str | None
    target: int | None
    hashid: str | None
    seq: int | None
    def __init__(
        self,
        message: str,
        *,
        code: str,
        operation: str | None = ...,
        target: int | None = ...,
        hashid: str | None = ...,
        seq: int | None = ...,
    ) -> None: ...

class RegisterError(CallregError):
    outcomes: dict[int, str]
    def __init__(self, message: str, *, outcomes: Mapping[int, str] | None = ..., **fields: Any) -> None: ...

class HandleError(CallregError): ...

class TargetLostError(CallregError):
    outcomes: dict[int, str]
    def __init__(self, message: str, *, outcomes: Mapping[int, str] | None = ..., **fields: Any) -> None: ...

class LifecycleError(CallregError): ...
class EnvelopeError(CallregError): ...

class TaskError(CallregError):
    remote_type: str | None
    remote_traceback: str | None
    def __init__(
        self,
        message: str,
        *,
        remote_type: str | None = ...,
        remote_traceback: str | None = ...,
        **fields: Any,
    ) -> None: ...

class RemoteTraceback(Exception):
    text: str
    def __init__(self, text: str) -> None: ...

class Handle(Generic[_P, _R]):
    """A registration of a callable taking ``_P`` and returning ``_R``."""
    def __init__(self, *args: Any, **kwargs: Any) -> NoReturn: ...
    @property
    def hashid(self) -> str: ...
    @property
    def digest(self) -> bytes: ...
    @property
    def kind(self) -> str: ...
    @property
    def namespace(self) -> str: ...
    def __copy__(self) -> Handle[_P, _R]: ...
    def __deepcopy__(self, memo: Any) -> Handle[_P, _R]: ...

def pack(fn: Callable[..., Any]) -> bytes: ...
def hashid(obj: bytes | bytearray | memoryview | Handle[..., Any] | Callable[..., Any]) -> str: ...

class NextLevel:
    targets: int | None
    setup: Callable[[Worker], Mapping[str, Handle[..., Any]] | None] | None
    next_level: NextLevel | None
    next_level_targets: int | None
    control_timeout: float
    operation_timeout: float | None
    slot_capacity: int
    max_frame_bytes: int
    probe_first: bool
    respawn_limit: int
    respawn_backoff: float
    def __init__(
        self,
        targets: int | None = ...,
        *,
        setup: Callable[[Worker], Mapping[str, Handle[..., Any]] | None] | None = ...,
        next_level: NextLevel | None = ...,
        next_level_targets: int | None = ...,
        control_timeout: float = ...,
        slot_capacity: int = ...,
        max_frame_bytes: int = ...,
        operation_timeout: float | None = ...,
        probe_first: bool = ...,
        respawn_limit: int = ...,
        respawn_backoff: float = ...,
    ) -> None: ...

class Context:
    inner: Worker
    handles: dict[str, Handle[..., Any]]
    target: int
    def __init__(self, inner: Worker, handles: dict[str, Handle[..., Any]], target: int) -> None: ...
    def close(self) -> None: ...

def context() -> Context | None: ...

class Worker:
    def __init__(
        self,
        targets: int | None = ...,
        *,
        next_level: NextLevel | None = ...,
        next_level_targets: int | None = ...,
        control_timeout: float = ...,
        slot_capacity: int = ...,
        max_frame_bytes: int = ...,
        operation_timeout: float | None = ...,
        probe_first: bool = ...,
        respawn_limit: int = ...,
        respawn_backoff: float = ...,
        initializer: Callable[..., object] | None = ...,
        initargs: Iterable[Any] = ...,
    ) -> None: ...
    def __enter__(self) -> Worker: ...
    def __exit__(self, *exc: object) -> bool: ...
    def register(self, fn: Callable[_P, _R], *, metadata: Mapping[str, Any] | None = ...) -> Handle[_P, _R]: ...
    def register_envelope(
        self, data: bytes | bytearray | memoryview, *, metadata: Mapping[str, Any] | None = ...
    ) -> Handle[..., Any]: ...
    def unregister(self, handle: Handle[..., Any]) -> None: ...
    def forgive(self, callable_or_hashid: str | bytes | Handle[..., Any] | Callable[..., Any]) -> bool: ...
    def start(self) -> dict[Handle[..., Any], RegisterError]: ...
    def close(self) -> None: ...
    # The target= keyword cannot join a ParamSpec: arguments are checked
    # by call_all and Executor.submit, the result type everywhere.
    def submit(
        self, handle: Handle[..., _R], /, *args: Any, target: int | None = ..., **kwargs: Any
    ) -> concurrent.futures.Future[_R]: ...
    def call(self, handle: Handle[..., _R], /, *args: Any, target: int | None = ..., **kwargs: Any) -> _R: ...
    def call_all(self, handle: Handle[_P, _R], /, *args: _P.args, **kwargs: _P.kwargs) -> dict[int, _R]: ...
    def map(
        self, handle: Handle[..., _R], /, *iterables: Iterable[Any], timeout: float | None = ..., chunksize: int = ...
    ) -> Iterator[_R]: ...
    @property
    def targets(self) -> list[int]: ...
    @property
    def sub_targets(self) -> list[int]: ...
    @property
    def next_level_targets(self) -> list[int]: ...
    def target_pid(self, target: int) -> int | None: ...
    def target_incarnation(self, target: int) -> int: ...
    def slot_phase(self, target: int) -> str: ...
    def slot_events(self) -> list[dict[str, Any]]: ...
    def inspect(self) -> dict[str, Any]: ...

class Executor(concurrent.futures.Executor):
    def __init__(
        self,
        max_workers: int | None = ...,
        *,
        initializer: Callable[..., object] | None = ...,
        initargs: Iterable[Any] = ...,
        control_timeout: float = ...,
        slot_capacity: int = ...,
        max_frame_bytes: int = ...,
        operation_timeout: float | None = ...,
        probe_first: bool = ...,
        respawn_limit: int = ...,
        respawn_backoff: float = ...,
    ) -> None: ...
    @property
    def worker(self) -> Worker: ...
    def submit(self, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> concurrent.futures.Future[_T]: ...
    def map(
        self,
        fn: Callable[..., _T],
        *iterables: Iterable[Any],
        timeout: float | None = ...,
        chunksize: int = ...,
    ) -> Iterator[_T]: ...
    def shutdown(self, wait: bool = ..., *, cancel_futures: bool = ...) -> None: ...
