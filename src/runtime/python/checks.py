"""Target-side helpers of callreg's metadata checks (specs/metadata.md)."""
import io as _io
import pickle as _pickle
import sys
import types as _types


def installed_version(name):
    """The installed version of distribution `name`, or None."""
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def check_pip(requirements):
    """None when `packaging` is not installed; otherwise one text per
    unsatisfied requirement, "REQUIREMENT (reason)"."""
    try:
        from packaging.requirements import InvalidRequirement, Requirement
    except ImportError:
        return None
    problems = []
    for text in requirements:
        try:
            requirement = Requirement(text)
        except InvalidRequirement as error:
            problems.append("%s (not a valid requirement: %s)" % (text, error))
            continue
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        version = installed_version(requirement.name)
        if version is None:
            problems.append("%s (not installed)" % text)
        elif not requirement.specifier.contains(version, prereleases=True):
            problems.append("%s (installed %s)" % (text, version))
    return problems


def _in_main(obj):
    """Whether `obj` is the function or class of that name in this
    process's __main__ (inherited through fork from the parent, which has
    it too)."""
    main = sys.modules.get("__main__")
    name = getattr(obj, "__qualname__", None)
    return (
        main is not None
        and isinstance(name, str)
        and getattr(obj, "__module__", None) == "__main__"
        and getattr(main, name, None) is obj
    )


try:
    import cloudpickle as _cloudpickle

    class ResultPickler(_cloudpickle.Pickler):
        """cloudpickle's pickler, except that the functions and classes of
        __main__ are pickled by name: the parent's __main__ has the same
        ones (the instance of a script's class comes back an instance of
        that class, as with pickle)."""

        def reducer_override(self, obj):
            # By type only, as cloudpickle's own reducer tells functions
            # and classes apart: no attribute of obj is read (a
            # __getattr__ of its class is never called).
            kind = type(obj)
            if issubclass(kind, type) or issubclass(kind, _types.FunctionType):
                if _in_main(obj):
                    return NotImplemented
            return super().reducer_override(obj)

except ImportError:
    ResultPickler = _pickle.Pickler


# Types whose instances pickle to the same bytes with ResultPickler as with
# pickle.dumps (cloudpickle's reducer leaves them to pickle): a result of
# exactly one of these types is pickle.dumps'd.
_PLAIN = frozenset((int, float, complex, str, bytes, bool, type(None)))

# A tuple, list or dict result whose items (keys and values) are all of
# plain types is pickle.dumps'd too (the pickler writes those containers
# itself, without a reducer), when it has at most this many items: past
# about 80 the look at each item's type costs more than the pickler.
_SCANNED_ITEMS = 32


def _plain_container(obj):
    """Whether obj is a tuple, list or dict of at most _SCANNED_ITEMS
    items whose types (keys' and values') are all plain."""
    kind = type(obj)
    if kind is tuple or kind is list:
        return len(obj) <= _SCANNED_ITEMS and _PLAIN.issuperset(map(type, obj))
    if kind is dict:
        return (
            len(obj) <= _SCANNED_ITEMS
            and _PLAIN.issuperset(map(type, obj))
            and _PLAIN.issuperset(map(type, obj.values()))
        )
    return False


def dump_result(obj, protocol):
    """A task's result pickled for the parent (ResultPickler). A plain
    result (of a _PLAIN type, or a _plain_container) is pickled by
    pickle.dumps: the same bytes, without the cost of making a
    cloudpickle pickler."""
    if type(obj) in _PLAIN or _plain_container(obj):
        return _pickle.dumps(obj, protocol)
    buffer = _io.BytesIO()
    ResultPickler(buffer, protocol=protocol).dump(obj)
    return buffer.getvalue()


# Attributes of builtin exceptions kept outside __dict__ (restored when an
# exception is rebuilt without its __init__).
_EXCEPTION_SLOTS = (
    "errno", "strerror", "filename", "filename2", "characters_written",
    "msg", "lineno", "offset", "text", "end_lineno", "end_offset",
    "value", "name", "path", "obj",
)


def dump_exception(exc, protocol, tb):
    """A task's exception (raised with traceback `tb`) pickled for the
    parent, or None when it cannot be: `exc.__callreg_remote__` is set
    first to (the full traceback.format_exception text, [(file, line,
    function), ...] of `tb`). When plain pickling does not unpickle (an exception whose
    own __init__ takes other arguments than its args), it is pickled as
    `copyreg.__newobj__(type)` with its args, __dict__ and builtin slots as
    state: rebuilt without calling __init__."""
    import copyreg
    import io
    import pickle
    import traceback
    base = ResultPickler
    try:
        text = "".join(traceback.format_exception(type(exc), exc, tb))
        frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(tb)]
    except Exception:
        text, frames = None, []
    try:
        exc.__callreg_remote__ = (text, frames)
    except Exception:
        pass

    def dump(pickler):
        buffer = io.BytesIO()
        pickler(buffer, protocol=protocol).dump(exc)
        return buffer.getvalue()

    try:
        blob = dump(base)
    except Exception:
        return None  # it refuses to be pickled: respected
    try:
        pickle.loads(blob)
        return blob
    except Exception:
        pass

    class Rebuilding(base):
        def reducer_override(self, obj):
            if obj is exc:
                state = dict(getattr(exc, "__dict__", {}))
                state["args"] = exc.args
                for name in _EXCEPTION_SLOTS:
                    # None is each slot's unset value (an OSError's str()
                    # would show one set to None).
                    if name not in state and getattr(exc, name, None) is not None:
                        state[name] = getattr(exc, name)
                return (copyreg.__newobj__, (type(exc),), state)
            parent = getattr(super(), "reducer_override", None)
            return NotImplemented if parent is None else parent(obj)

    try:
        blob = dump(Rebuilding)
        pickle.loads(blob)
        return blob
    except Exception:
        return None


def call_capturing(fn, args, kwargs):
    """fn(*args, **kwargs) with sys.stdout and sys.stderr captured:
    {"result": ..., "stdout": "...", "stderr": "..."}."""
    import contextlib
    import io
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        result = fn(*args, **kwargs)
    return {"result": result, "stdout": out.getvalue(), "stderr": err.getvalue()}


def mp_child_start():
    """In a target, right after its fork and before its initializer: what
    a child of multiprocessing's own does first (BaseProcess._bootstrap):
    the parent's multiprocessing children are not this process's, the
    parent's finalizers do not run here, and the after-fork hooks of
    multiprocessing objects (a Queue's feeder, a Lock's state) run. Only
    when multiprocessing is imported."""
    process = sys.modules.get("multiprocessing.process")
    util = sys.modules.get("multiprocessing.util")
    if process is None or util is None:
        return
    process._children = set()
    util._finalizer_registry.clear()
    util._run_after_forkers()


def mp_child_stop():
    """In a target that stops serving (its control channel closed): what
    a child of multiprocessing's own does at its end (util._exit_function):
    runs the finalizers, which flush what a task put in a Queue (its
    feeder thread is joined), and joins the multiprocessing children the
    target started. Only when multiprocessing is imported."""
    util = sys.modules.get("multiprocessing.util")
    if util is not None:
        util._exit_function()

