"""Tests of callreg_envelope: the specs/design.md §3.1/§3.2 known vector, envelope
checks, and a pack round trip through the command.

Run: ``python3 -m unittest python/tools/test_callreg_envelope.py`` (needs
cloudpickle; ``cargo test --test python_envelope_tool`` runs it too).
"""

import contextlib
import io
import json
import os
import pickle
import struct
import sys
import tempfile
import textwrap
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import callreg_envelope  # noqa: E402

KNOWN_PAYLOAD = bytes.fromhex("80054e2e")
KNOWN_ENVELOPE_HEX = "5350594301010000040000000000000080054e2e"
KNOWN_HASHID = "sha256:8d96f0f9bfdddf028d9c22f471496088efc60377264fc7b3d6382f32782ecbd1"


class KnownVector(unittest.TestCase):
    def test_envelope_of_known_payload(self):
        self.assertEqual(callreg_envelope.wrap(KNOWN_PAYLOAD).hex(), KNOWN_ENVELOPE_HEX)

    def test_hashid_of_known_envelope(self):
        self.assertEqual(callreg_envelope.hashid(bytes.fromhex(KNOWN_ENVELOPE_HEX)), KNOWN_HASHID)

    def test_descriptor_of_known_envelope(self):
        descriptor = callreg_envelope.descriptor(bytes.fromhex(KNOWN_ENVELOPE_HEX))
        self.assertEqual(len(descriptor), 52)
        self.assertEqual(struct.unpack_from("<IIIII", descriptor), (1, 2, 1, 1, 32))

    def test_trailing_bytes_are_ignored(self):
        padded = bytes.fromhex(KNOWN_ENVELOPE_HEX) + b"\0" * 100
        self.assertEqual(callreg_envelope.hashid(padded), KNOWN_HASHID)

    def test_dumps_of_none_is_the_known_envelope(self):
        # cloudpickle.dumps(None) with protocol 5 is exactly 80 05 4e 2e.
        self.assertEqual(callreg_envelope.dumps(None).hex(), KNOWN_ENVELOPE_HEX)


class EnvelopeChecks(unittest.TestCase):
    def check_rejected(self, envelope, fragment):
        with self.assertRaises(ValueError) as caught:
            callreg_envelope.hashid(envelope)
        self.assertIn(fragment, str(caught.exception))

    def test_short_header(self):
        self.check_rejected(bytes.fromhex(KNOWN_ENVELOPE_HEX)[:15], "shorter than the 16-byte")

    def test_bad_magic(self):
        self.check_rejected(b"SPYX" + bytes.fromhex(KNOWN_ENVELOPE_HEX)[4:], "magic")

    def test_bad_version(self):
        self.check_rejected(struct.pack("<4sBBHQ", b"SPYC", 2, 1, 0, 4) + KNOWN_PAYLOAD, "version 2")

    def test_bad_serializer(self):
        self.check_rejected(struct.pack("<4sBBHQ", b"SPYC", 1, 7, 0, 4) + KNOWN_PAYLOAD, "serializer 7")

    def test_nonzero_flags(self):
        self.check_rejected(struct.pack("<4sBBHQ", b"SPYC", 1, 1, 1, 4) + KNOWN_PAYLOAD, "flags")

    def test_size_over_staged_bytes(self):
        self.check_rejected(struct.pack("<4sBBHQ", b"SPYC", 1, 1, 0, 2**64 - 1) + KNOWN_PAYLOAD, "declares")


MODULE_SOURCE = textwrap.dedent(
    """
    import functools

    def add(a, b):
        return a + b

    double = lambda x: 2 * x

    class Greeter:
        def __call__(self, name):
            return "hello " + name

    greet = Greeter()
    cube = functools.partial(pow, exp=3)
    _private = lambda: None
    LIMIT = 10
    """
)


class PackRoundTrip(unittest.TestCase):
    def setUp(self):
        self.directory = tempfile.TemporaryDirectory()
        self.source = os.path.join(self.directory.name, "roundtrip_module.py")
        with open(self.source, "w") as file:
            file.write(MODULE_SOURCE)
        self.out = os.path.join(self.directory.name, "out")

    def tearDown(self):
        sys.modules.pop("roundtrip_module", None)
        self.directory.cleanup()

    def run_command(self, source):
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            status = callreg_envelope.main([source, "--out", self.out])
        return status, stdout.getvalue().splitlines()

    def test_pack_all_public_callables(self):
        status, lines = self.run_command(self.source)
        self.assertEqual(status, 0)
        names = ["add", "double", "Greeter", "greet", "cube"]
        self.assertEqual(
            sorted(os.listdir(self.out)),
            sorted([n + ".spyc" for n in names] + [n + ".spyc.json" for n in names]),
        )
        self.assertEqual(len(lines), len(names))
        for name, line in zip(names, lines, strict=True):
            path = os.path.join(self.out, name + ".spyc")
            with open(path, "rb") as file:
                envelope = file.read()
            self.assertEqual(line, "%s  %s" % (callreg_envelope.hashid(envelope), path))
            self.assertEqual(envelope[:8], b"SPYC\x01\x01\x00\x00")
            self.assertEqual(struct.unpack_from("<Q", envelope, 8)[0], len(envelope) - 16)
        # The module is gone: the payloads must carry their code by value.
        sys.modules.pop("roundtrip_module", None)
        loaded = {}
        for name in names:
            with open(os.path.join(self.out, name + ".spyc"), "rb") as file:
                loaded[name] = pickle.loads(callreg_envelope.parse(file.read())[2])
        self.assertEqual(loaded["add"](2, 3), 5)
        self.assertEqual(loaded["double"](21), 42)
        self.assertEqual(loaded["Greeter"]()("ann"), "hello ann")
        self.assertEqual(loaded["greet"]("bob"), "hello bob")
        self.assertEqual(loaded["cube"](3), 27)
        self.assertNotIn("roundtrip_module", sys.modules)

    def test_pack_one_name(self):
        status, lines = self.run_command(self.source + ":LIMIT")
        self.assertEqual(status, 0)
        self.assertEqual(sorted(os.listdir(self.out)), ["LIMIT.spyc", "LIMIT.spyc.json"])
        with open(os.path.join(self.out, "LIMIT.spyc"), "rb") as file:
            envelope = file.read()
        self.assertEqual(pickle.loads(callreg_envelope.parse(envelope)[2]), 10)
        self.assertEqual(lines, ["%s  %s" % (callreg_envelope.hashid(envelope), os.path.join(self.out, "LIMIT.spyc"))])

    def test_sidecar_metadata_has_the_versions_filled_in(self):
        import platform

        import cloudpickle

        callreg_envelope.pack(self.source, self.out, "add")
        with open(os.path.join(self.out, "add.spyc.json"), encoding="utf-8") as file:
            text = file.read()
        expected = {
            "name": "add",
            "python": {
                "version": platform.python_version(),
                "serializer": "cloudpickle",
                "serializer_version": cloudpickle.__version__,
            },
            "executor": "python",
            "deps": {"pip": {"packages": []}, "bash": {"commands": []}},
            "call_before": [],
            "call_after": [],
        }
        self.assertEqual(json.loads(text), expected)
        # Key order and layout are those of the JSON form callreg prints.
        self.assertEqual(list(json.loads(text)), list(expected))
        self.assertEqual(text, json.dumps(expected, indent=2) + "\n")

    def test_sidecar_takes_callreg_metadata_from_the_source(self):
        with open(self.source, "a") as file:
            file.write(
                "CALLREG_METADATA = {'add': {'executor_data': {'type': 'PythonExecutor', "
                "'short_name': 'python', 'attributes': {'capture_output': True}}, "
                "'deps': {'pip': {'packages': ['cloudpickle>=2']}}}}\n"
            )
        callreg_envelope.pack(self.source, self.out, "add")
        with open(os.path.join(self.out, "add.spyc.json"), encoding="utf-8") as file:
            written = json.load(file)
        self.assertEqual(written["executor"], "python")
        self.assertEqual(written["executor_data"]["attributes"], {"capture_output": True})
        self.assertEqual(written["deps"], {"pip": {"packages": ["cloudpickle>=2"]}, "bash": {"commands": []}})

    def test_unknown_callreg_metadata_key_is_an_error(self):
        with self.assertRaisesRegex(ValueError, r"CALLREG_METADATA\['add'\] has unknown key\(s\) colour"):
            callreg_envelope.metadata("add", {"colour": "red"})

    def test_pack_is_deterministic(self):
        first = callreg_envelope.pack(self.source, self.out, "add")[0][2]
        sys.modules.pop("roundtrip_module", None)
        second = callreg_envelope.pack(self.source, self.out, "add")[0][2]
        self.assertEqual(first, second)

    def test_unknown_name_is_one_line_error(self):
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            status, lines = self.run_command(self.source + ":missing")
        self.assertEqual(status, 1)
        self.assertEqual(lines, [])
        self.assertEqual(
            stderr.getvalue(),
            "callreg_envelope: LookupError: %s defines no top-level name 'missing'\n" % self.source,
        )


if __name__ == "__main__":
    unittest.main()
