"""callreg: register Python callables into forked worker processes by
content identity, and run tasks on them as futures.

A :class:`Worker` forks *targets* (child processes) from the calling
interpreter. :meth:`Worker.register` packs a callable with
``cloudpickle.dumps`` into a SPYC envelope, whose hashid (``sha256:...``)
names it everywhere, and installs it in every target; the returned
:class:`Handle` runs tasks with :meth:`Worker.submit` (a
:class:`concurrent.futures.Future`), :meth:`Worker.call`,
:meth:`Worker.call_all` and :meth:`Worker.map`::

    import callreg

    scale = 3
    with callreg.Worker(4) as w:
        w.start()
        h = w.register(lambda x: x * scale)
        print(w.call_all(h, 14))         # {0: 42, 1: 42, 2: 42, 3: 42}
        w.unregister(h)

Process model (Linux):

* :meth:`Worker.start` forks the targets with the interpreter's own fork
  steps, as :func:`os.fork` does (``os.register_at_fork`` hooks run, the
  child's interpreter is valid). Like :func:`os.fork`, it forks even when
  the process runs other threads: only the calling thread exists in a
  target, and a lock another thread held at that moment stays held there
  (an idle extra thread is harmless; CPython itself warns about this
  since 3.12, and so does ``start()``, with a ``RuntimeWarning``). Any
  thread may call it: the forks run on a thread the Worker owns, so the
  targets live until the Worker closes (or this process dies), whether or
  not the calling thread ends first.
* ``start_method="forkserver"`` (and ``preload``, modules to import
  first) starts a fresh interpreter instead, which forks every target:
  nothing of this process's threads, locks or memory reaches a target
  (:class:`Worker`; ``specs/python.md``, "Start methods").
* A target keeps the interpreter it inherited: the modules imported and
  the globals set before ``start()`` are there. Every callable, whether
  registered before or after ``start()``, is installed in the target from
  its envelope (``cloudpickle.loads``), so both behave the same: a
  callable registered before ``start()`` is not the parent's original
  object, and state it holds is a copy per target.
* Arguments and results travel pickled with cloudpickle both ways (a
  lambda can be an argument or a result). A task's exception is raised
  here as itself: an instance of its own type and of :class:`TaskError`
  (``except ZeroDivisionError`` catches it), with the remote type, the
  full remote traceback and a :class:`RemoteTraceback` as ``__cause__``.
* :class:`Executor` is a :class:`concurrent.futures.Executor` over a
  Worker: ``submit(fn, ...)`` registers ``fn`` once, at its first use.
* A Worker belongs to the process that built it: in a child forked from
  it, it raises :class:`LifecycleError` and closing it does nothing.
* Every wait releases the GIL. Ctrl-C while :meth:`Worker.call` waits
  raises :class:`KeyboardInterrupt` in the caller and leaves the Worker
  usable (the task still finishes in its target; its result is dropped).
* Tasks are sent at submit; a future's ``cancel()`` still stops a task
  that has not started in its target (it then never runs), and a task
  may have a deadline (``timeout=``; :class:`TaskTimeoutError`, its
  target killed and replaced). Otherwise a task ends when its target
  answers, is lost (e.g. killed: :class:`TargetLostError`) or the Worker
  closes (:class:`LifecycleError`).
* :meth:`Worker.close` (also on leaving a ``with`` block, when the Worker
  is garbage-collected, and at interpreter exit) stops and reaps the
  targets; staged payloads are sealed anonymous memory files that the
  kernel frees with their last descriptor (nothing is ever named in
  ``/dev/shm``).
* Trees: ``Worker(targets, next_level=NextLevel(...), next_level_targets=M)``
  adds M next-level targets (ids after the SUB targets), each running an
  inner Worker of its own; callables registered on the outer Worker run
  there as ``fn(ctx, *args, **kwargs)`` (:class:`Context`). See
  :class:`Worker` and ``specs/python.md`` §5.
* An ``async def`` function is refused by :meth:`Worker.register` (its call
  would only return a coroutine); register a plain function that runs it,
  e.g. ``lambda *a: asyncio.run(coro_fn(*a))``. A generator function's call
  returns a generator, which cannot be pickled: ``result()`` raises the
  pickling error (``TypeError``); return a list.
"""

from callreg import _callreg
from callreg._envelope import OUT_OF_BAND_MIN_BYTES, hashid, pack
from callreg._errors import (
    CallregError,
    EnvelopeError,
    HandleError,
    LifecycleError,
    RegisterError,
    RemoteTraceback,
    ResultError,
    TargetLostError,
    TaskError,
    TaskInputError,
    TaskTimeoutError,
)
from callreg._executor import Executor, TaskOptions, options
from callreg._handle import KIND as KIND
from callreg._handle import NAMESPACE as NAMESPACE
from callreg._handle import Handle
from callreg._options import DEFAULT_MAX_FRAME_BYTES
from callreg._tree import Context, NextLevel, context
from callreg._worker import Worker

__all__ = [
    "Executor",
    "options",
    "TaskOptions",
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
    "TaskInputError",
    "ResultError",
    "TaskTimeoutError",
    "RemoteTraceback",
    "DEFAULT_MAX_FRAME_BYTES",
    "OUT_OF_BAND_MIN_BYTES",
]

__version__: str = _callreg.VERSION
"""The package's version (``"MAJOR.MINOR.PATCH"``), as installed."""

# Each public class and function is known by its name here (in reprs,
# tracebacks and pickles), wherever it is defined.
for _public in (
    Executor,
    options,
    TaskOptions,
    TaskTimeoutError,
    Worker,
    NextLevel,
    Context,
    context,
    Handle,
    pack,
    hashid,
    CallregError,
    RegisterError,
    HandleError,
    TargetLostError,
    LifecycleError,
    EnvelopeError,
    TaskError,
    TaskInputError,
    ResultError,
    RemoteTraceback,
):
    _public.__module__ = __name__
del _public
