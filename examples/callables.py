"""Example callables, one of each shape callreg registers.

Pack them into SPYC envelopes, one ``.spyc`` per exported name::

    python3 python/tools/callreg_envelope.py examples/callables.py --out payloads

Every name in ``__all__`` is packed, including ``settings`` (a dict, not a
callable: registering it fails with a TypeError naming ``dict``) and
``fails_to_unpickle`` (packing works; unpickling it in a target raises).

Each envelope gets a metadata side-car ``NAME.spyc.json`` (interpreter and
cloudpickle versions filled in), which ``callreg run`` registers with it.
``load_config``, ``scaled`` and ``greet`` show the rest of the metadata in
``examples/plan.json``: ``scaled`` runs with ``load_config`` as a
``call_before`` hook whose result becomes its ``config`` keyword argument,
and ``greet`` runs with the executor attribute ``capture_output``, declared
here in ``CALLREG_METADATA``.
"""

import functools
import time

__all__ = [
    "add",
    "square",
    "scale_by_3",
    "multiplier",
    "power_of_2",
    "divide",
    "sleep_for",
    "busy_for",
    "fails_to_unpickle",
    "settings",
    "load_config",
    "scaled",
    "greet",
]

CALLREG_METADATA = {
    "greet": {
        "executor": "python",
        "executor_data": {
            "type": "PythonExecutor",
            "short_name": "python",
            "attributes": {"capture_output": True},
        },
    },
}


def add(a, b):
    """A plain function: ``add(2, 3) == 5``."""
    return a + b


square = lambda x: x * x  # noqa: E731 -- a lambda on purpose: ``square(7) == 49``


def _make_scaler(factor):
    def scale(x):
        return x * factor

    return scale


scale_by_3 = _make_scaler(3)
"""A closure over ``factor = 3``: ``scale_by_3(5) == 15``."""


class Multiplier:
    """A callable object: ``Multiplier(k)(x) == k * x``."""

    def __init__(self, factor):
        self.factor = factor

    def __call__(self, x):
        return self.factor * x


multiplier = Multiplier(10)
"""A callable object: ``multiplier(4) == 40``."""

power_of_2 = functools.partial(pow, exp=2)
"""A ``functools.partial``: ``power_of_2(9) == 81``."""


def divide(a, b):
    """Raises ``ZeroDivisionError`` when ``b == 0``: ``divide(1, 0)``."""
    return a / b


def sleep_for(seconds):
    """Long-running: sleeps ``seconds`` seconds, then returns ``seconds``."""
    time.sleep(seconds)
    return seconds


def busy_for(seconds):
    """Long-running and CPU-bound: runs Python bytecode (holding the GIL
    between switch intervals) for ``seconds`` seconds, then returns
    ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pass
    return seconds


def _refuse_to_unpickle(message):
    raise RuntimeError(message)


class _FailsToUnpickle:
    """Pickles fine; unpickling it calls ``_refuse_to_unpickle``, which raises
    ``RuntimeError``."""

    def __call__(self):
        return "unreachable: unpickling fails first"

    def __reduce__(self):
        return (_refuse_to_unpickle, ("this payload refuses to be unpickled",))


fails_to_unpickle = _FailsToUnpickle()
"""Registering it fails with ``RuntimeError: this payload refuses to be
unpickled``."""

settings = {"retries": 3}
"""Not callable: registering it fails with a TypeError naming ``dict``."""


def load_config():
    """A ``call_before`` hook: returns the configuration ``scaled`` needs."""
    return {"factor": 3}


def scaled(x, config):
    """Scales ``x`` by ``config["factor"]`` (``config`` comes from the
    ``load_config`` hook): ``scaled(5) == 15``."""
    return x * config["factor"]


def greet(name):
    """Prints a line and returns a greeting; with ``capture_output`` the
    result is ``{"result": "hello NAME", "stdout": "greeting NAME\\n",
    "stderr": ""}``."""
    print("greeting", name)
    return "hello " + name
