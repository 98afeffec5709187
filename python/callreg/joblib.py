"""A joblib backend on callreg targets: ``joblib.Parallel`` and every
library built on it (scikit-learn's ``n_jobs``: ``GridSearchCV``,
``cross_val_score``, ``RandomForestClassifier``, ...) run their batches
in a :class:`callreg.Executor`'s targets (``specs/python.md`` §3c)::

    import joblib
    import callreg.joblib  # registers the backend "callreg"

    with joblib.parallel_config(backend="callreg", n_jobs=4):
        print(joblib.Parallel()(joblib.delayed(abs)(-i) for i in range(5)))  # [0, 1, 2, 3, 4]

Importing this module registers the backend under the name ``"callreg"``
(:func:`joblib.register_parallel_backend`); it needs joblib installed
(``pip install joblib``). Keyword arguments given to
``parallel_config(backend="callreg", ...)`` beside joblib's own go to the
:class:`callreg.Executor` (``mp_context``, ``initializer``, a Worker's
options).

Each ``Parallel`` call (joblib's ``configure``) starts an Executor of
``n_jobs`` targets (``-1``: one per CPU, ``-2``: all but one, as joblib
counts), runs every batch there, and shuts it down when the call ends;
``n_jobs=1`` runs in this process (joblib's sequential backend). A batch
travels as the argument of one registered function, so no batch is
registered: each crosses once, pickled with cloudpickle (closures and
lambdas included), as with loky. Batch sizes are joblib's automatic ones.
A task's exception is raised by ``Parallel`` as itself. When a call
fails, the batches not started are cancelled and the targets stopped
(:meth:`callreg.Executor.terminate_workers`)."""

from __future__ import annotations

import os
from typing import Any

from joblib._parallel_backends import (
    AutoBatchingMixin,
    FallbackToBackend,
    ParallelBackendBase,
    SequentialBackend,
)
from joblib.parallel import register_parallel_backend

from callreg._executor import Executor
from callreg._options import WORKER_OPTIONS

# What configure passes on to the Executor of what joblib gives it.
_EXECUTOR_OPTIONS = WORKER_OPTIONS | {"mp_context", "initializer", "initargs"}

__all__ = ["CallregBackend", "NAME"]

NAME = "callreg"
"""The name the backend is registered under."""


def _run_batch(batch: Any) -> Any:
    """Runs one joblib batch (a ``BatchedCalls``) in a target."""
    return batch()


class CallregBackend(AutoBatchingMixin, ParallelBackendBase):
    """joblib's backend interface over a :class:`callreg.Executor` (the
    module's docs). ``executor_options`` are the Executor's keyword
    arguments."""

    supports_retrieve_callback = True
    supports_inner_max_num_threads = False

    def __init__(
        self, nesting_level: int | None = None, inner_max_num_threads: int | None = None, **executor_options: Any
    ) -> None:
        super().__init__(nesting_level=nesting_level, inner_max_num_threads=inner_max_num_threads)
        self._executor_options = executor_options
        self._executor: Executor | None = None
        self.parallel: Any = None

    def effective_n_jobs(self, n_jobs: int | None) -> int:
        """The number of targets for ``n_jobs`` as joblib counts it:
        ``None`` is 1, a negative number counts back from the CPUs
        (``-1``: all). Raises ``ValueError`` for 0."""
        if n_jobs == 0:
            raise ValueError("n_jobs == 0 in Parallel has no meaning")
        if n_jobs is None:
            return 1
        if n_jobs < 0:
            return max((os.cpu_count() or 1) + 1 + n_jobs, 1)
        return int(n_jobs)

    def configure(
        self, n_jobs: int | None = 1, parallel: Any = None, prefer: Any = None, require: Any = None, **options: Any
    ) -> int:
        """Starts the Executor of this ``Parallel`` call; returns its
        number of targets. One job runs here (joblib's sequential
        backend); ``require="sharedmem"`` too (a target shares no memory
        with this process)."""
        n_jobs = self.effective_n_jobs(n_jobs)
        if n_jobs == 1 or require == "sharedmem":
            raise FallbackToBackend(SequentialBackend(nesting_level=self.nesting_level))
        self.parallel = parallel
        if self._executor is None:
            # joblib's own options (max_nbytes, temp_folder, mmap_mode,
            # verbose, its default multiprocessing context) have no use
            # here; the Executor's go on.
            given = {k: v for k, v in options.items() if k in _EXECUTOR_OPTIONS}
            self._executor = Executor(n_jobs, **{**self._executor_options, **given})
        return n_jobs

    def submit(self, func: Any, callback: Any = None) -> Any:
        """Sends one batch to a target; ``callback`` runs when it ends."""
        if self._executor is None:
            raise RuntimeError("the callreg joblib backend is not configured: use it through joblib.Parallel")
        future = self._executor.submit(_run_batch, func)
        if callback is not None:
            future.add_done_callback(callback)
        return future

    def retrieve_result_callback(self, out: Any) -> Any:
        """The batch's results (or what it raised, raised)."""
        return out.result()

    def terminate(self) -> None:
        """Shuts the Executor down once its batches ended (the end of a
        ``Parallel`` call)."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        self.reset_batch_stats()

    def abort_everything(self, ensure_ready: bool = True) -> None:
        """A batch failed: cancels the batches not started and stops the
        targets; with ``ensure_ready``, a new Executor for the next
        call."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.terminate_workers()
        if ensure_ready and self.parallel is not None:
            self.configure(n_jobs=self.parallel.n_jobs, parallel=self.parallel)


register_parallel_backend(NAME, CallregBackend)
