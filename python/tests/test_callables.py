"""Callable shapes, arguments and results, task exceptions, handles."""

import collections
import concurrent.futures
import copy
import dataclasses
import functools
import math
import os
import pickle
import sys
import time

import cloudpickle
import pytest
from conftest import outputs_of

import callreg
import callreg._callables
import callreg._envelope

TARGETS = 3


def add(a, b=0):
    return a + b


def fact(n):
    return 1 if n <= 1 else n * fact(n - 1)


def countdown(n):
    while n > 0:
        yield n
        n -= 1


async def coroutine_fn(x):
    return x


class Scaler:
    def __init__(self, factor):
        self.factor = factor

    def __call__(self, x):
        return x * self.factor

    def scale(self, x):
        return x * self.factor + 1


def make_closure(k):
    def inner(x):
        return x + k

    return inner


@dataclasses.dataclass(frozen=True)
class Point:
    x: int
    y: float


def identity(x):
    return x


def pid_of(_=None):
    import os

    return os.getpid()


SHAPES = [
    ("function", add, (2, 3), 5),
    ("lambda", lambda x: x * 2, (21,), 42),
    ("closure", make_closure(10), (5,), 15),
    ("callable object", Scaler(3), (4,), 12),
    ("bound method", Scaler(3).scale, (4,), 13),
    ("partial", functools.partial(add, b=100), (1,), 101),
    ("recursive", fact, (10,), 3628800),
]


@pytest.mark.parametrize("when", ["before start", "after start"])
def test_every_callable_shape_runs_on_every_target(when):
    with callreg.Worker(TARGETS) as w:
        handles = {}
        if when == "before start":
            handles = {name: w.register(fn) for name, fn, _, _ in SHAPES}
            w.start()
        else:
            w.start()
            handles = {name: w.register(fn) for name, fn, _, _ in SHAPES}
        for name, _, args, expected in SHAPES:
            assert w.call_all(handles[name], *args) == {t: expected for t in range(TARGETS)}, name
            for target in range(TARGETS):
                assert w.call(handles[name], *args, target=target) == expected


def test_keyword_arguments_and_submit_target():
    with callreg.Worker(2) as w:
        w.start()
        h = w.register(add)
        assert w.call(h, 1, b=2) == 3
        assert w.submit(h, a=5, b=6, target=1).result(timeout=10) == 11


def test_a_generator_function_is_refused_at_register_naming_the_fix():
    with callreg.Worker(1) as w:
        w.start()
        with pytest.raises(TypeError) as info:
            w.register(countdown)
        assert str(info.value) == (
            "countdown is a generator function: its call would return a generator, which a target cannot "
            "send back; register a function that returns what it yields (e.g. a list of it)"
        )
        # A generator's values can be returned as a list.
        lister = w.register(lambda n: list(countdown(n)))
        assert w.call(lister, 3) == [3, 2, 1]
        # A generator a task returns still fails as the pickling error.
        maker = w.register(lambda n: countdown(n))
        with pytest.raises(TypeError) as info:
            w.call(maker, 3)
        assert type(info.value) is TypeError
        assert str(info.value) == "cannot pickle 'generator' object"
        if sys.version_info >= (3, 11):
            assert info.value.__notes__[0] == "(raised pickling the task's result, of type 'generator', in its target)"


def test_an_async_function_is_refused_at_register():
    with callreg.Worker(1) as w:
        with pytest.raises(TypeError, match="async function"):
            w.register(coroutine_fn)


def test_register_refuses_non_callables_and_bad_arguments():
    with pytest.raises(TypeError, match="^targets must be an int, not str$"):
        callreg.Worker("4")
    # What the Worker cannot run is a value error, by option name (as
    # ProcessPoolExecutor's max_workers=0 is).
    with pytest.raises(ValueError, match="^targets must be an int from 1 to 65535, got 0$"):
        callreg.Worker(0)
    with pytest.raises(ValueError, match="^slot_capacity must be an int from 1 to 65535, got 0$"):
        callreg.Worker(1, slot_capacity=0)
    with pytest.raises(ValueError, match="^max_frame_bytes must be an int from 256 to 18446744073709551615, got 255$"):
        callreg.Worker(1, max_frame_bytes=255)
    assert callreg._options.MIN_MAX_FRAME_BYTES == 256
    with pytest.raises(ValueError, match="^control_timeout must be positive, got 0.0$"):
        callreg.Worker(1, control_timeout=0)
    with pytest.raises(TypeError, match="^slot_capacity must be an int, not float$"):
        callreg.Worker(1, slot_capacity=1.5)
    with pytest.raises(ValueError, match="^slot_capacity must be an int from 1 to 65535, got 65536$"):
        callreg.Worker(1, slot_capacity=65536)
    with pytest.raises(ValueError, match="^targets must be an int from 1 to 65535, got -1$"):
        callreg.Worker(-1)
    with callreg.Worker(1) as w:
        with pytest.raises(TypeError):
            w.register(42)
        with pytest.raises(TypeError):
            w.register_envelope("not bytes")
        with pytest.raises(TypeError):
            w.register(add, metadata=["not", "a", "dict"])
        h = w.register(add)
        w.start()
        with pytest.raises(TypeError):
            w.call(h, 1, target="0")


VALUES = [
    None,
    True,
    2**200 + 1,
    -(2**70),
    1.5,
    float("inf"),
    "text ünïcode",
    b"\x00\xffbytes",
    bytearray(b"ba"),
    [1, [2, [3, {"k": (4, 5)}]]],
    {"a": {1, 2}, "b": frozenset({3})},
    {1, 2, 3},
    (1, "two", 3.0),
    Point(1, 2.5),
    complex(1, 2),
]


def test_arguments_and_results_of_many_types():
    with callreg.Worker(2) as w:
        w.start()
        h = w.register(identity)
        for value in VALUES:
            assert w.call(h, value) == value, value
            assert w.submit(h, value).result(timeout=10) == value
        nan = w.call(h, float("nan"))
        assert isinstance(nan, float) and math.isnan(nan)
        assert w.call(h, Point(3, 4.0)) == Point(3, 4.0)


def make_subclassed(value):
    """Instances of subclasses of plain types, the classes defined here
    (pickled by value)."""

    class Meters(int):
        pass

    class Label(str):
        pass

    return Meters(value), Label("m%d" % value)


def test_results_of_subclasses_of_plain_types_keep_their_class():
    with callreg.Worker(1) as w:
        w.start()
        h = w.register(make_subclassed)
        meters, label = w.call(h, 3)
        assert (type(meters).__name__, meters, type(meters).__mro__[1]) == ("Meters", 3, int)
        assert (type(label).__name__, label, type(label).__mro__[1]) == ("Label", "m3", str)
        alone = w.register(lambda v: make_subclassed(v)[0])
        assert type(w.call(alone, 5)).__name__ == "Meters"
        assert w.call(h, True) == (1, "m1")
        # In containers: a tuple, list or dict of plain items is pickled
        # by pickle, one holding anything else is not.
        held = w.register(
            lambda v: (
                [make_subclassed(v)[0]],
                {"label": make_subclassed(v)[1]},
                {make_subclassed(v)[1]: 1},
                (1, make_subclassed(v)[0]),
            )
        )
        in_list, in_values, in_keys, in_tuple = w.call(held, 7)
        assert [type(x).__name__ for x in in_list] == ["Meters"]
        assert [type(x).__name__ for x in in_values.values()] == ["Label"]
        assert [type(x).__name__ for x in in_keys] == ["Label"]
        assert type(in_tuple[1]).__name__ == "Meters" and in_tuple == (1, 7)


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((7, "x", None), {}),
        (([1, 2.5], (b"k", True), {"k": complex(1, 2)}), {"n": 3}),
        ((list(range(32)), list(range(33))), {}),
        (([lambda v: v],), {}),
        (({"f": len},), {}),
        (({make_subclassed(1)[1]: 1},), {}),
        (((1, make_subclassed(2)[0]),), {"x": [make_subclassed(3)[0]]}),
    ],
)
def test_a_task_input_is_the_bytes_cloudpickle_gives(args, kwargs):
    # Plain arguments (and small containers of them) are pickled by
    # pickle, anything else by cloudpickle: the bytes are the same.
    assert callreg._envelope.task_input(args, kwargs) == cloudpickle.dumps((args, kwargs), protocol=5)


def test_containers_of_local_classes_and_lambdas_as_arguments():
    with callreg.Worker(1) as w:
        w.start()
        h = w.register(lambda seq, mapping: ([type(x).__name__ for x in seq], sorted(mapping)))
        meters, label = make_subclassed(4)
        assert w.call(h, [meters, 1], {label: 1}) == (["Meters", "int"], ["m4"])
        apply = w.register(lambda fs, x: [f(x) for f in fs])
        assert w.call(apply, [lambda v: v + 1, abs], -5) == [-4, 5]


def test_containers_of_lambdas_as_results():
    with callreg.Worker(1) as w:
        w.start()
        h = w.register(lambda k: ((lambda x: x + k), [lambda x: x * k], {"f": lambda x: x - k}))
        add, (mul,), sub = w.call(h, 3)
        assert (add(1), mul(2), sub["f"](10)) == (4, 6, 7)


RESULTS_BY_NAME_PROGRAM = """
import collections, concurrent.futures, multiprocessing, sys, threading
import callreg

LOCK = threading.Lock()

def f(x):
    with LOCK:
        return x + 1

def get_f(_):
    return f

class AttrDict(dict):
    def __getattr__(self, key):
        if key == "__getstate__":  # pickle asks for it before Python 3.11
            raise AttributeError(key)
        return self[key]

class AutoDict(collections.defaultdict):
    def __getattr__(self, key):
        if key == "__getstate__":
            raise AttributeError(key)
        return self[key]

def dicts(_):
    auto = AutoDict(int)
    auto["hits"] = 3
    return AttrDict(a=1), auto

class MyError(Exception):
    pass

def boom(_):
    raise MyError(AttrDict(code=7))

if sys.argv[1] == "ppe":
    pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork"))
else:
    pool = callreg.Executor(1)
with pool:
    returned = pool.submit(get_f, 0).result()
    attr, auto = pool.submit(dicts, 0).result()
    error = pool.submit(boom, 0).exception()
    print(returned is f, returned(1), dict(attr), dict(auto))
    print(isinstance(error, MyError), error.args)
"""


def test_results_pickle_main_functions_by_name_and_never_read_attributes_of_objects():
    # A function of a script's __main__ comes back as the parent's own
    # (the result holds it by name, as pickle does: a copy by value would
    # fail on its global lock); an object whose class has a __getattr__
    # is pickled as pickle pickles it (no attribute of it is read: an
    # AttrDict would raise KeyError, an AutoDict would gain a key); the
    # same goes for a raised exception. As with ProcessPoolExecutor.
    outputs = outputs_of(RESULTS_BY_NAME_PROGRAM)
    assert outputs["callreg"] == outputs["ppe"] == "True 2 {'a': 1} {'hits': 3}\nTrue ({'code': 7},)\n"


class AttrCall(dict):
    """A callable dict whose missing attributes raise KeyError (but
    ``__getstate__``, which pickle asks for before Python 3.11)."""

    def __getattr__(self, key):
        if key == "__getstate__":
            raise AttributeError(key)
        return self[key]

    def __call__(self, x):
        return x + self["k"]


class AutoCall(collections.defaultdict):
    """A callable dict that adds every attribute it is asked for (but
    ``__getstate__``)."""

    def __getattr__(self, key):
        if key == "__getstate__":
            raise AttributeError(key)
        return self[key]

    def __call__(self):
        return sorted(self)


def test_registering_reads_no_attribute_of_a_callable_object():
    # Its name, the async check and the code registry look at the
    # object's type and instance __dict__ only: an AttrCall would raise
    # KeyError, an AutoCall would gain keys before it is pickled.
    auto = AutoCall(int)
    auto["z"] = 1
    with callreg.Worker(1) as w:
        w.start()
        assert w.call(w.register(AttrCall(k=2)), 1) == 3
        assert w.call(w.register(auto)) == ["z"]
        with callreg.Executor(1) as ex:
            assert ex.submit(AttrCall(k=5), 1).result(timeout=10) == 6
    assert dict(auto) == {"z": 1}
    assert callreg._callables.callable_name(auto) == "AutoCall"


def test_a_64_mib_bytes_argument_and_result():
    big = bytes(range(256)) * (64 * 1024 * 1024 // 256)
    with callreg.Worker(2) as w:
        w.start()
        h = w.register(lambda b: b[::-1])
        out = w.call(h, big)
        assert len(out) == len(big) and out == big[::-1]
        assert w.submit(h, big, target=1).result(timeout=60) == big[::-1]


def test_a_lambda_as_argument_and_as_result():
    with callreg.Worker(2) as w:
        w.start()
        apply = w.register(lambda f, x: f(x))
        assert w.call(apply, lambda v: v * 7, 6) == 42
        maker = w.register(lambda k: lambda x: x + k)
        returned = w.call(maker, 5)
        assert returned(1) == 6


class CustomError(Exception):
    def __init__(self, message, detail):
        super().__init__(message, detail)
        self.detail = detail


class Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("this exception cannot be pickled")


def raises_custom(detail):
    raise CustomError("custom failure", detail)


def raises_unpicklable():
    raise Unpicklable("no way back")


def divide(a, b):
    return a / b


def test_task_exceptions_carry_type_message_traceback_and_cause():
    with callreg.Worker(2) as w:
        w.start()
        h = w.register(divide)
        with pytest.raises(ZeroDivisionError) as info:
            w.call(h, 1, 0)
        error = info.value
        # The task's own exception, exactly: its type, args, str; nothing
        # of callreg's on it. Where it ran is on its cause.
        assert type(error) is ZeroDivisionError
        assert error.args == ("division by zero",)
        assert str(error) == "division by zero"
        assert not hasattr(error, "code") and not hasattr(error, "hashid")
        cause = error.__cause__
        assert type(cause) is callreg.RemoteTraceback
        assert cause.remote_type == "ZeroDivisionError"
        assert cause.hashid == h.hashid
        assert cause.target in (0, 1)
        assert isinstance(cause.seq, int)
        if sys.version_info >= (3, 11):
            assert error.__notes__ == ["(raised by a callreg task on target %d, hashid %s)" % (cause.target, h.hashid)]
        assert cause.text == (
            "Traceback (most recent call last):\n"
            '  File "%s", line %d, in divide\n'
            "    return a / b\n"
            "%s"
            "ZeroDivisionError: division by zero\n"
            % (
                divide.__code__.co_filename,
                divide.__code__.co_firstlineno + 1,
                "           ~~^~~\n" if sys.version_info >= (3, 11) else "",
            )
        )
        assert str(cause) == cause.text
        # The same through a future: exception() gives it, result() raises it.
        future = w.submit(h, 1, 0)
        raised = future.exception(timeout=10)
        assert type(raised) is ZeroDivisionError and type(raised.__cause__) is callreg.RemoteTraceback
        with pytest.raises(ZeroDivisionError):
            future.result()

        custom = w.register(raises_custom)
        with pytest.raises(CustomError) as info:
            w.call(custom, {"why": [1, 2]})
        assert type(info.value) is CustomError
        assert info.value.__cause__.remote_type.endswith("CustomError")
        assert info.value.detail == {"why": [1, 2]}
        assert info.value.args == ("custom failure", {"why": [1, 2]})

        rich = w.register(raises_rich)
        with pytest.raises(RichError) as info:
            w.call(rich, 5)
        assert (str(info.value), info.value.number, info.value.args) == ("rich failure 5", 5, ("rich failure 5",))

        missing = w.register(open_missing)
        with pytest.raises(FileNotFoundError) as info:
            w.call(missing, "/nonexistent/callreg-file")
        assert (info.value.errno, info.value.filename) == (2, "/nonexistent/callreg-file")

        unpicklable = w.register(raises_unpicklable)
        with pytest.raises(callreg.TaskError) as info:
            w.call(unpicklable)
        assert type(info.value) is callreg.TaskError
        assert info.value.remote_type.endswith("Unpicklable")
        assert "no way back" in str(info.value)
        assert info.value.__cause__ is None
        # Its traceback is whole too: the source named, the exception's
        # own line last.
        line = raises_unpicklable.__code__.co_firstlineno + 1
        assert info.value.remote_traceback == (
            "Traceback (most recent call last):\n"
            '  File "%s", line %d, in raises_unpicklable\n'
            '    raise Unpicklable("no way back")\n'
            "%s: no way back\n"
            % (os.path.basename(raises_unpicklable.__code__.co_filename), line, info.value.remote_type)
        )
        # The Worker is still usable.
        assert w.call(h, 6, 3) == 2.0


class RichError(Exception):
    """An exception whose __init__ takes other arguments than its args."""

    def __init__(self, number):
        super().__init__("rich failure %d" % number)
        self.number = number


def raises_rich(number):
    raise RichError(number)


def open_missing(path):
    with open(path):
        pass


def test_remote_tracebacks_are_whole_and_name_the_source_of_by_value_code():
    def inner(x):
        raise KeyError(x)

    def outer(x):
        try:
            inner(x)
        except KeyError as error:
            raise ValueError("outer %s" % x) from error

    with callreg.Worker(1) as w:
        w.start()
        h = w.register(outer)
        with pytest.raises(ValueError) as info:
            w.call(h, "k")
        text = info.value.__cause__.text
        assert str(info.value) == "outer k"
        here = __file__
        line = outer.__code__.co_firstlineno
        assert (
            '  File "%s", line %d, in inner\n    raise KeyError(x)\n' % (here, inner.__code__.co_firstlineno + 1)
            in text
        )
        assert '  File "%s", line %d, in outer\n    inner(x)\n' % (here, line + 2) in text
        assert "KeyError: 'k'\n\nThe above exception was the direct cause of the following exception:\n" in text
        assert text.endswith("ValueError: outer k\n")
        assert "<dynamic-code>" not in text


def test_an_unpicklable_result_raises_the_pickling_error():
    with callreg.Worker(1) as w:
        w.start()
        h = w.register(lambda: __import__("threading").Lock())
        with pytest.raises(TypeError) as info:
            w.call(h)
        assert type(info.value) is TypeError
        assert str(info.value) == "cannot pickle '_thread.lock' object"
        assert info.value.__cause__.remote_type == "TypeError"


class RefusedHere:
    """Pickles anywhere; unpickles only in a target (a forked child)."""

    def __init__(self, parent):
        self.parent = parent

    def __reduce__(self):
        return (_only_in_a_target, (self.parent,))


def _only_in_a_target(parent):
    if os.getpid() == parent:
        raise ValueError("not in the parent")
    return RefusedHere(parent)


def test_a_result_that_does_not_unpickle_here_is_a_result_error_from_what_unpickling_raised():
    with callreg.Worker(1) as w:
        w.start()
        h = w.register(lambda parent: RefusedHere(parent))
        for wait in (lambda: w.call(h, os.getpid()), lambda: w.submit(h, os.getpid()).result()):
            with pytest.raises(callreg.ResultError) as info:
                wait()
            assert str(info.value) == (
                "the task returned, but its result could not be unpickled in this process: "
                "ValueError: not in the parent"
            )
            assert (info.value.code, info.value.operation) == ("DESERIALIZE_FAILED", "result")
            assert type(info.value.__cause__) is ValueError
            assert info.value.__cause__.args == ("not in the parent",)
        assert w.call(abs_handle(w), -2) == 2


def abs_handle(w):
    return w.register(abs)


def test_handles_are_immutable_hashable_and_equal_only_to_themselves():
    with callreg.Worker(1) as w:
        a = w.register(add)
        b = w.register(add)
        assert a != b and a == a and hash(a) != hash(b)
        assert a.hashid == b.hashid == callreg.hashid(add)
        assert a.hashid.startswith("sha256:") and len(a.hashid) == 7 + 64
        assert a.digest == bytes.fromhex(a.hashid[7:])
        assert a.kind == "PYTHON_SERIALIZED"
        assert a.namespace == "LOCAL_PYTHON"
        assert repr(a).startswith("<callreg.Handle sha256:") and "LOCAL_PYTHON" in repr(a)
        assert {a: 1, b: 2}[a] == 1
        assert copy.copy(a) is a and copy.deepcopy(a) is a
        with pytest.raises(AttributeError):
            a.hashid = "x"
        with pytest.raises(AttributeError):
            a._raw = None
        with pytest.raises(TypeError):
            pickle.dumps(a)
        with pytest.raises(TypeError):
            callreg.Handle()
        w.start()
        # Two handles, one callable: unregistering one keeps the other.
        w.unregister(a)
        assert w.call(b, 2, 2) == 4
        with pytest.raises(callreg.HandleError) as info:
            w.call(a, 1)
        assert info.value.code == "HANDLE_STALE"


def test_unregister_then_call_and_foreign_and_forged_handles():
    with callreg.Worker(2) as w, callreg.Worker(1) as other:
        w.start()
        other.start()
        h = w.register(add)
        theirs = other.register(add)
        assert theirs.hashid == h.hashid
        for call in (lambda x: w.call(x, 1), lambda x: w.submit(x, 1).result(timeout=10)):
            with pytest.raises(callreg.HandleError) as info:
                call(theirs)
            assert info.value.code == "HANDLE_FOREIGN"
            for forged in (h.hashid, None, 42):
                with pytest.raises(callreg.HandleError) as info:
                    call(forged)
                assert info.value.code == "HANDLE_FOREIGN"
        with pytest.raises(callreg.HandleError) as info:
            w.unregister(theirs)
        assert info.value.code == "HANDLE_FOREIGN"
        w.unregister(h)
        with pytest.raises(callreg.HandleError) as info:
            w.call(h, 1)
        assert info.value.code == "HANDLE_STALE"
        with pytest.raises(callreg.HandleError) as info:
            w.unregister(h)
        assert info.value.code == "HANDLE_STALE"
        assert other.call(theirs, 1, 1) == 2


def test_pack_and_hashid():
    envelope = callreg.pack(add)
    assert envelope[:4] == b"SPYC" and len(envelope) > 16
    assert callreg.hashid(envelope) == callreg.hashid(add)
    assert callreg.hashid(bytearray(envelope)) == callreg.hashid(add)
    with pytest.raises(callreg.EnvelopeError) as info:
        callreg.hashid(b"not an envelope at all")
    assert info.value.code == "ENVELOPE_INVALID"
    # Computing a hashid decodes: no register is involved.
    assert str(info.value) == 'ENVELOPE_INVALID: bad magic 6e6f7420 (expected 53505943, "SPYC") (operation decode)'
    with pytest.raises(TypeError):
        callreg.hashid(3)
    with callreg.Worker(1) as w:
        w.start()
        h = w.register_envelope(envelope)
        assert h.hashid == callreg.hashid(add)
        assert w.call(h, 20, 22) == 42
        with pytest.raises(callreg.EnvelopeError):
            w.register_envelope(b"SPYC" + b"\x00" * 4)


def test_map_and_call_all():
    with callreg.Worker(3) as w:
        w.start()
        h = w.register(add)
        assert list(w.map(h, range(100), range(100))) == [2 * i for i in range(100)]
        pid = w.register(pid_of)
        pids = set(w.map(pid, range(30)))
        assert pids == {w.target_pid(t) for t in w.targets}
        assert w.call_all(pid) == {t: w.target_pid(t) for t in range(3)}
        slow = w.register(lambda s: __import__("time").sleep(s))
        with pytest.raises(concurrent.futures.TimeoutError):
            list(w.map(slow, [2], timeout=0.2))


def test_the_package_exports_its_names_and_types_its_extension():
    import ast

    from callreg import _callreg

    assert callreg.__all__ == [
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
    # Every public class and function is known by its name in the package
    # (reprs, tracebacks, pickles), whichever module defines it.
    named = {name: getattr(getattr(callreg, name), "__module__", None) for name in callreg.__all__}
    constants = {"DEFAULT_MAX_FRAME_BYTES": None, "OUT_OF_BAND_MIN_BYTES": None}
    assert named == dict.fromkeys(callreg.__all__[:-2], "callreg") | constants
    assert (callreg.KIND, callreg.NAMESPACE, callreg.DEFAULT_MAX_FRAME_BYTES, callreg.OUT_OF_BAND_MIN_BYTES) == (
        "PYTHON_SERIALIZED",
        "LOCAL_PYTHON",
        256 * 1024 * 1024,
        1024 * 1024,
    )
    package = os.path.dirname(callreg.__file__)
    assert os.path.exists(os.path.join(package, "py.typed"))
    # The extension's stub names everything the extension defines.
    with open(os.path.join(package, "_callreg.pyi")) as f:
        stub = ast.parse(f.read())
    stubbed = {node.name for node in stub.body if isinstance(node, (ast.ClassDef, ast.FunctionDef))}
    stubbed |= {node.target.id for node in stub.body if isinstance(node, ast.AnnAssign)}
    defined = {name for name in vars(_callreg) if not name.startswith("__")}
    assert stubbed - {"_ErrorFields"} == defined


def slow_increment(x):
    time.sleep(1.0)
    return x + 1


def test_a_done_callback_raising_system_exit_strands_no_later_future(caplog):
    with callreg.Worker(1) as w:
        w.start()
        slow = w.register(slow_increment)
        h = w.register(lambda x: x + 1)
        first = w.submit(slow, 7)
        # Added while the task runs (it takes a second): the dispatcher
        # thread runs it.
        first.add_done_callback(lambda f: sys.exit("from a done-callback"))
        assert first.result(timeout=10) == 8
        # The dispatcher went on: later futures resolve.
        assert [w.submit(h, i).result(timeout=10) for i in range(5)] == [1, 2, 3, 4, 5]
        assert w.call(h, 9) == 10
    assert "a done-callback of a callreg future raised" in caplog.text


TYPED_PROGRAM = """
import callreg

def add(a: int, b: int) -> int:
    return a + b

w = callreg.Worker(1)
h = w.register(add)
total: int = w.call(h, 1, 2)
every: dict[int, int] = w.call_all(h, 1, 2)
later: int = w.submit(h, 1, 2).result()
wrong_result: str = w.call(h, 1, 2)
w.call_all(h, 1, "2")
ex = callreg.Executor(1)
fine: int = ex.submit(add, 1, b=2).result()
ex.submit(add, "1", 2)
ex.submit(add, 1)
mapped: list[int] = list(ex.map(add, [1], [2]))
annotated: callreg.Handle[[int, int], int] = h
"""


def test_the_stubs_type_results_and_check_arguments(tmp_path):
    mypy = pytest.importorskip("mypy.api")
    program = tmp_path / "typed.py"
    program.write_text(TYPED_PROGRAM)
    out, err, status = mypy.run(["--no-error-summary", "--show-error-codes", "--no-incremental", str(program)])
    errors = sorted(
        (int(line.split(":")[1]), line.rsplit("[", 1)[1].rstrip("]")) for line in out.splitlines() if ": error:" in line
    )
    assert errors == [(12, "assignment"), (13, "arg-type"), (16, "arg-type"), (17, "call-arg")], out + err
    assert status == 1
    # Handle[...] also works at run time (in annotations evaluated eagerly).
    assert callreg.Handle[[int, int], int].__origin__ is callreg.Handle


def test_metadata_that_is_not_json_is_refused_naming_why():
    with callreg.Worker(1) as w:
        for metadata, reason in (
            ({"executor_data": {"x": float("nan")}}, "Out of range float values are not JSON compliant"),
            ({"executor_data": {"x": object()}}, "Object of type object is not JSON serializable"),
        ):
            with pytest.raises(callreg.CallregError) as info:
                w.register(add, metadata=metadata)
            assert info.value.code == "METADATA_INVALID"
            assert str(info.value).startswith("METADATA_INVALID: the metadata is not JSON: " + reason)
        deep = {}
        for _ in range(100000):
            deep = {"d": deep}
        with pytest.raises(callreg.CallregError, match="the metadata is not JSON: it nests too deeply"):
            w.register(add, metadata={"executor_data": deep})


def test_a_callable_has_one_metadata_while_it_is_registered():
    with callreg.Worker(2) as w:
        before = w.register(add)
        with pytest.raises(callreg.CallregError) as info:
            w.register(add, metadata={"name": "another name"})
        assert info.value.code == "METADATA_CONFLICT"
        assert "is registered with metadata sha256:" in str(info.value)
        assert "a register of it with metadata sha256:" in str(info.value)
        w.start()
        again = w.register(add)  # the same metadata: a second handle
        assert again != before and again.hashid == before.hashid
        with pytest.raises(callreg.CallregError, match="METADATA_CONFLICT"):
            w.register(add, metadata={"name": "after start"})
        w.unregister(before)
        w.unregister(again)
        other = w.register(add, metadata={"name": "another name"})
        assert w.call_all(other, 1, 2) == {0: 3, 1: 3}


def test_numpy_numbers_are_options_and_targets_as_python_numbers_are():
    np = pytest.importorskip("numpy")
    with callreg.Worker(
        np.int64(2),
        control_timeout=np.float32(5),
        slot_capacity=np.uint16(8),
        respawn_backoff=np.float64(0.5),
        spin=np.float32(1e-5),
    ) as w:
        w.start()
        h = w.register(abs)
        assert w.call(h, -3, target=np.int64(1), timeout=np.float32(5)) == 3
        assert w.submit(h, -4, target=np.uint8(0)).result() == 4
        assert w.targets == [0, 1]
    with pytest.raises(TypeError, match="^control_timeout must be a number of seconds, not str$"):
        callreg.Worker(1, control_timeout="5")
    with pytest.raises(TypeError, match="^spin must be a number of seconds, not bool$"):
        callreg.Worker(1, spin=True)
    # An int too large for a float: a ValueError naming the option, for
    # every option in seconds.
    for option in ("control_timeout", "operation_timeout", "respawn_backoff", "spin"):
        with pytest.raises(ValueError, match="^%s must be a finite number of seconds, got 1000000000" % option):
            callreg.Worker(1, **{option: 10**400})
    with pytest.raises(TypeError, match="^targets must be an int, not float64$"):
        callreg.Worker(np.float64(2))


def test_task_options_are_checked_by_name():
    np = pytest.importorskip("numpy")
    with callreg.Worker(1) as w:
        w.start()
        h = w.register(abs)
        with pytest.raises(TypeError, match="^timeout must be a number of seconds, not bool$"):
            w.submit(h, 3, timeout=True)
        with pytest.raises(TypeError, match="^timeout must be a number of seconds, not str$"):
            w.call(h, 3, timeout="1")
        with pytest.raises(ValueError, match="^timeout must be at most 1000000000 seconds, got 1e300$"):
            w.call(h, 3, timeout=1e300)
        with pytest.raises(ValueError, match="^timeout must be a finite number of seconds, got -1000000000"):
            w.submit(h, 3, timeout=-(10**400))
        with pytest.raises(TypeError, match="^task_timeout must be a number of seconds, not bool$"):
            w.map(h, [1], task_timeout=False)
        with pytest.raises(TypeError, match="^out_of_band must be True or False, not str$"):
            w.register(abs, out_of_band="x")
        with pytest.raises(TypeError, match="^out_of_band must be True or False, not int$"):
            callreg.pack(abs, out_of_band=1)
        assert list(w.map(h, [-1, -2, -3], chunksize=np.int64(2))) == [1, 2, 3]
        with pytest.raises(TypeError, match="^chunksize must be an int, not float64$"):
            w.map(h, [1], chunksize=np.float64(2))
    with callreg.Executor(1) as ex:
        assert list(ex.map(abs, [-1, -2, -3], chunksize=np.int32(2))) == [1, 2, 3]


def test_a_workers_repr_says_its_state():
    w = callreg.Worker(1)
    assert repr(w) == "<callreg.Worker of 1 target, not started>"
    w.start()
    assert repr(w) == "<callreg.Worker of 1 target, live targets [0]>"
    w.close()
    assert repr(w) == "<callreg.Worker of 1 target, closed>"
    with callreg.Worker(2) as two:
        two.start()
        assert repr(two) == "<callreg.Worker of 2 targets, live targets [0, 1]>"
