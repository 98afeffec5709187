"""Make SPYC envelopes of Python callables and compute their hashids.

Standard library and cloudpickle only; Python 3.8 or later.

Formats (specs/design.md §3, specs/formats.md):

* SPYC envelope (3.1): a 16-byte little-endian header -- magic ``b"SPYC"``,
  u8 version 1, u8 serializer 1 (CLOUDPICKLE), u16 flags 0, u64
  payload_size -- followed by the serializer payload,
  ``cloudpickle.dumps(fn)``.
* Descriptor and hashid (3.2): the PYTHON_SERIALIZED descriptor is 52 bytes,
  u32 LE each: schema version 1, callable kind 2, payload format version
  (the envelope version), serializer id (the envelope serializer), then the
  length-prefixed sha256 of the payload (u32 32 and 32 bytes). The hashid is
  ``"sha256:"`` + the lowercase hex sha256 of the descriptor.

Command::

    python3 python/tools/callreg_envelope.py FILE.py[:NAME] --out DIR

imports FILE.py as a module, registers it with
``cloudpickle.register_pickle_by_value`` (so its functions and classes are
pickled by value and the target need not import FILE.py), and writes one
envelope ``DIR/<name>.spyc`` per exported name, with its metadata side-car
``DIR/<name>.spyc.json`` (see ``metadata``), printing ``<hashid>  <path>``
for each envelope. Exported names: NAME alone when given;
otherwise the names in the module's ``__all__`` when it defines one (packed
whatever they are, so a non-callable can be packed on purpose); otherwise
every public top-level callable defined in the file (not imported into it).

Metadata side-car (specs/metadata.md): a JSON object with the
callable's ``name``, the producer's ``python`` versions (interpreter and
cloudpickle, filled in by this tool), ``executor`` (default ``"python"``),
``deps`` and the ``call_before`` / ``call_after`` hooks. FILE.py may give
per-name metadata in a top-level dict ``CALLREG_METADATA = {NAME: {...}}``
with any of the keys ``executor``, ``executor_data``, ``deps``,
``call_before``, ``call_after``.
"""

import argparse
import hashlib
import importlib.util
import inspect
import json
import os
import platform
import struct
import sys

MAGIC = b"SPYC"
"""The envelope's first four bytes."""

ENVELOPE_VERSION = 1
"""The only envelope version (the payload format version of descriptors)."""

SERIALIZER_CLOUDPICKLE = 1
"""The only serializer id: the payload is ``cloudpickle.dumps(fn)``."""

HEADER = struct.Struct("<4sBBHQ")
"""Header layout: magic, version (u8), serializer (u8), flags (u16),
payload_size (u64), little-endian, 16 bytes."""

SCHEMA_VERSION = 1
"""Descriptor schema version."""

KIND_PYTHON_SERIALIZED = 2
"""Descriptor callable kind of a serialized Python callable."""


def wrap(payload):
    """Return the SPYC envelope (bytes) around serializer payload ``payload``
    (bytes-like): the 16-byte header then the payload."""
    payload = bytes(payload)
    return HEADER.pack(MAGIC, ENVELOPE_VERSION, SERIALIZER_CLOUDPICKLE, 0, len(payload)) + payload


def dumps(fn):
    """Return the SPYC envelope (bytes) of ``cloudpickle.dumps(fn)``.

    Raises whatever cloudpickle raises for an object it cannot pickle, and
    ``ModuleNotFoundError`` when cloudpickle is not installed."""
    import cloudpickle

    return wrap(cloudpickle.dumps(fn))


def parse(envelope):
    """Return ``(version, serializer, payload)`` of a SPYC envelope.

    Checks in specs/design.md §3.1 order: at least 16 bytes, magic, version,
    serializer, flags, payload size (bytes after the declared payload are
    ignored). Raises ``ValueError`` naming the first failed check."""
    envelope = memoryview(envelope).cast("B")
    if len(envelope) < HEADER.size:
        raise ValueError("envelope shorter than the 16-byte SPYC header: %d bytes" % len(envelope))
    magic, version, serializer, flags, size = HEADER.unpack_from(envelope)
    if magic != MAGIC:
        raise ValueError("bad envelope magic %r (expected b'SPYC')" % magic)
    if version != ENVELOPE_VERSION:
        raise ValueError("unsupported envelope version %d (expected 1)" % version)
    if serializer != SERIALIZER_CLOUDPICKLE:
        raise ValueError("unsupported serializer %d (expected 1, CLOUDPICKLE)" % serializer)
    if flags != 0:
        raise ValueError("envelope flags must be 0, got %d" % flags)
    if size > len(envelope) - HEADER.size:
        raise ValueError(
            "envelope declares a %d-byte payload but holds %d bytes after the header"
            % (size, len(envelope) - HEADER.size)
        )
    return version, serializer, bytes(envelope[HEADER.size : HEADER.size + size])


def descriptor(envelope):
    """Return the 52-byte PYTHON_SERIALIZED descriptor (bytes) of a SPYC
    envelope. Raises ``ValueError`` for an invalid envelope (see ``parse``)."""
    version, serializer, payload = parse(envelope)
    return (
        struct.pack("<IIIII", SCHEMA_VERSION, KIND_PYTHON_SERIALIZED, version, serializer, 32)
        + hashlib.sha256(payload).digest()
    )


def hashid(envelope):
    """Return the hashid (``"sha256:"`` + 64 lowercase hex digits) of a SPYC
    envelope. Raises ``ValueError`` for an invalid envelope (see ``parse``)."""
    return "sha256:" + hashlib.sha256(descriptor(envelope)).hexdigest()


SIDECAR_SUFFIX = ".json"
"""The side-car of ``NAME.spyc`` is ``NAME.spyc.json``."""

DEFAULT_EXECUTOR = "python"
"""The executor short name of metadata that names none."""

METADATA_KEYS_FROM_SOURCE = ("executor", "executor_data", "deps", "call_before", "call_after")
"""The metadata keys a source file's ``CALLREG_METADATA`` may give."""


def metadata(name, extra=None):
    """Return the metadata (a dict in the key order of the JSON form) of the
    callable ``name``: this interpreter's version and cloudpickle's, the
    default executor, no deps, no hooks, then the keys of ``extra`` (a
    dict with keys from ``METADATA_KEYS_FROM_SOURCE``) over them.

    Raises ``ValueError`` naming an unknown key of ``extra`` and
    ``ModuleNotFoundError`` when cloudpickle is not installed."""
    import cloudpickle

    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(METADATA_KEYS_FROM_SOURCE))
    if unknown:
        raise ValueError(
            "CALLREG_METADATA[%r] has unknown key(s) %s (allowed: %s)"
            % (name, ", ".join(unknown), ", ".join(METADATA_KEYS_FROM_SOURCE))
        )
    result = {
        "name": name,
        "python": {
            "version": platform.python_version(),
            "serializer": "cloudpickle",
            "serializer_version": cloudpickle.__version__,
        },
        "executor": extra.get("executor", DEFAULT_EXECUTOR),
    }
    if "executor_data" in extra:
        result["executor_data"] = extra["executor_data"]
        if "executor" not in extra:
            result["executor"] = extra["executor_data"].get("short_name", DEFAULT_EXECUTOR)
    deps = extra.get("deps", {})
    result["deps"] = {
        "pip": {"packages": list(deps.get("pip", {}).get("packages", []))},
        "bash": {"commands": list(deps.get("bash", {}).get("commands", []))},
    }
    result["call_before"] = list(extra.get("call_before", []))
    result["call_after"] = list(extra.get("call_after", []))
    return result


def metadata_json(value):
    """The side-car text of metadata ``value``: JSON indented by two spaces,
    UTF-8 kept as is, with a final newline (the layout ``callreg`` prints)."""
    return json.dumps(value, indent=2, ensure_ascii=False) + "\n"


def load_module(path):
    """Import the Python file at ``path`` as a module named after its file
    stem, registered in ``sys.modules`` (cloudpickle requires it there to
    pickle the module by value). Raises what importing the file raises."""
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError("cannot import %s as a Python module" % path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def exported_names(module):
    """Return the names the command packs from ``module`` when no NAME is
    given: ``__all__`` if defined, else every public top-level callable that
    is not a module and was defined in the module itself (functions and
    classes imported from elsewhere are skipped), in definition order."""
    explicit = getattr(module, "__all__", None)
    if explicit is not None:
        return list(explicit)
    names = []
    for name, value in vars(module).items():
        if name.startswith("_") or inspect.ismodule(value) or not callable(value):
            continue
        if (inspect.isfunction(value) or inspect.isclass(value)) and (
            getattr(value, "__module__", None) != module.__name__
        ):
            continue
        names.append(name)
    return names


def pack(path, out_dir, name=None):
    """Write ``<out_dir>/<name>.spyc`` for each exported name of the Python
    file ``path`` (or just ``name``), pickling the file's own code by value.

    Also writes each envelope's metadata side-car ``<name>.spyc.json``
    (``metadata``, with the file's ``CALLREG_METADATA[name]`` when given).

    Returns a list of ``(name, envelope_path, hashid)`` in order. Raises
    ``LookupError`` when ``name`` is not defined in the file, ``ValueError``
    when the file exports nothing or ``CALLREG_METADATA`` is not a dict of
    dicts with known keys, and what importing the file or cloudpickle
    raises."""
    import cloudpickle

    module = load_module(path)
    if name is not None:
        if not hasattr(module, name):
            raise LookupError("%s defines no top-level name %r" % (path, name))
        names = [name]
    else:
        names = exported_names(module)
        if not names:
            raise ValueError("%s exports no callable" % path)
    given = getattr(module, "CALLREG_METADATA", {})
    if not isinstance(given, dict) or not all(isinstance(v, dict) for v in given.values()):
        raise ValueError("%s: CALLREG_METADATA must be a dict of dicts, by name" % path)
    sidecars = {each: metadata(each, given.get(each)) for each in names}
    cloudpickle.register_pickle_by_value(module)
    try:
        os.makedirs(out_dir, exist_ok=True)
        written = []
        for each in names:
            envelope = dumps(getattr(module, each))
            target = os.path.join(out_dir, each + ".spyc")
            with open(target, "wb") as file:
                file.write(envelope)
            with open(target + SIDECAR_SUFFIX, "w", encoding="utf-8") as file:
                file.write(metadata_json(sidecars[each]))
            written.append((each, target, hashid(envelope)))
        return written
    finally:
        cloudpickle.unregister_pickle_by_value(module)


def main(argv=None):
    """The command line (see the module docstring). Returns the exit status:
    0 on success, 1 with a one-line message on standard error otherwise."""
    parser = argparse.ArgumentParser(description="Pack the callables of a Python file into SPYC envelopes (.spyc).")
    parser.add_argument("source", metavar="FILE.py[:NAME]", help="the Python file, and optionally one name in it")
    parser.add_argument("--out", required=True, metavar="DIR", help="directory for the .spyc files")
    args = parser.parse_args(argv)
    path, _, name = args.source.partition(":")
    try:
        written = pack(path, args.out, name or None)
    except Exception as error:  # one readable line, never a traceback
        print("callreg_envelope: %s: %s" % (type(error).__name__, error), file=sys.stderr)
        return 1
    for _, target, identity in written:
        print("%s  %s" % (identity, target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
