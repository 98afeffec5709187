"""The template process of a Worker started with
``start_method="forkserver"`` (``specs/python.md``, "Start methods").

:func:`template_command` is what the parent runs: this interpreter
(``sys.executable``) with a bootstrap that takes the parent's
``sys.path``, then :func:`main`. The working directory, the environment
and the standard streams are the parent's (inherited). :func:`main`
hands the extension's template loop :func:`prepare`, which imports each
``preload`` module and returns the target initializer; the template then
forks every target, those of the start and every replacement.
"""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import pickle
import sys
from collections.abc import Callable, Sequence

import cloudpickle

from callreg import _callreg

# Run by ``python -c``: sys.argv[1] is the parent's sys.path (JSON).
_BOOTSTRAP = "import sys, json; sys.path[:] = json.loads(sys.argv[1]); from callreg._forkserver import main; main()"


def template_command(
    preload: Sequence[str], target_initializer: Callable[[int], object] | None
) -> tuple[str, list[str], bytes, str | None]:
    """The template of a forkserver Worker for the extension: ``(program,
    args, runtime_data, before_ready)``. The runtime data is a pickle of
    the preload module names and the target initializer (cloudpickled: it
    may be a lambda or a closure); ``before_ready`` names the preload
    modules for a start error when the template exits or hangs before it
    is ready (``None`` without them)."""
    try:
        initializer = None if target_initializer is None else cloudpickle.dumps(target_initializer)
    except RuntimeError as e:
        # multiprocessing's Queue, Lock, Pipe... refuse pickling outside
        # the start of one of its own processes ("should only be shared
        # between processes through inheritance").
        raise RuntimeError(
            "the initializer or initargs hold a multiprocessing object that only a forked process can inherit "
            "(%s); under start_method='forkserver' (mp_context forkserver or spawn) pass a "
            "multiprocessing.Manager() proxy instead (manager.Queue(), manager.Lock(): they travel by address), "
            "or use start_method='fork'" % (e,)
        ) from e
    data = {
        "preload": list(preload),
        "initializer": initializer,
        # The parent's multiprocessing authentication key: a Manager's
        # proxy (in initargs or a task's arguments) connects to its
        # manager with it, from the template and every target.
        "authkey": bytes(multiprocessing.current_process().authkey),
    }
    before_ready = "it imports the preload modules %r first" % (list(preload),) if preload else None
    return sys.executable, ["-c", _BOOTSTRAP, json.dumps(sys.path)], pickle.dumps(data), before_ready


def prepare(data: bytes) -> Callable[[int], object] | None:
    """In the template: takes the parent's multiprocessing authentication
    key, imports each preload module, in order, and returns the target
    initializer. Raises ``RuntimeError`` naming what failed (the
    parent's ``start()`` raises it with this message)."""
    spec = pickle.loads(data)
    multiprocessing.current_process().authkey = spec["authkey"]
    for name in spec["preload"]:
        try:
            importlib.import_module(name)
        except BaseException as e:
            raise RuntimeError("preload module %r failed to import: %s: %s" % (name, type(e).__name__, e)) from e
    if spec["initializer"] is None:
        return None
    try:
        initializer: Callable[[int], object] = cloudpickle.loads(spec["initializer"])
    except BaseException as e:
        raise RuntimeError(
            "the target initializer could not be unpickled in the template process: %s: %s" % (type(e).__name__, e)
        ) from e
    return initializer


def main() -> None:
    """The template process's entry point: serves the parent until it
    closes, then ends with the template's status."""
    code = _callreg._template_main(prepare)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
