"""The Python calls a target makes to decode a small task input and encode
its result (`src/runtime/python/input.rs`, `src/runtime/python/output.rs`),
each beside the calls it made before, interleaved round by round in one
process; CPU time per call (`time.process_time`), medians over the rounds.

| step | now | before (the peer) |
|---|---|---|
| JSON input | `JSONDecoder().raw_decode(s, 0)`, end checked | `json.loads(s)` |
| JSON result | one prebuilt `JSONEncoder(allow_nan=False, separators=(",", ":")).encode` | `json.dumps(r, allow_nan=False, separators=(",", ":"))` |
| pickled input (small) | `pickle.loads(bytes(b))` (one copy) | `pickle.loads(memoryview(b))`, then `release()` |

The inputs are those of `benches/floors.rs`'s Python round trip
(`{"args":[7]}`) and a pickled `((7,), {})`.

Run: `python3 benches/python_decode.py [ROUNDS]` (default 9). Results in
benchmarks/HISTORY.md ("A task that finds the target idle").
"""

import json
import os
import pickle
import statistics
import sys
import time

CALLS = 20000

TEXT = '{"args":[7]}'
RESULT = 7
PICKLED = pickle.dumps(((7,), {}))

DECODER = json.JSONDecoder()
ENCODER = json.JSONEncoder(allow_nan=False, separators=(",", ":"))


def json_input_now():
    obj, end = DECODER.raw_decode(TEXT, 0)
    assert end == len(TEXT)
    return obj


def json_input_before():
    return json.loads(TEXT)


def json_result_now():
    return ENCODER.encode(RESULT)


def json_result_before():
    return json.dumps(RESULT, allow_nan=False, separators=(",", ":"))


def pickle_input_now():
    return pickle.loads(bytes(PICKLED))


def pickle_input_before():
    view = memoryview(PICKLED)
    obj = pickle.loads(view)
    view.release()
    return obj


def empty():
    return None


def per_call(function):
    start = time.process_time()
    for _ in range(CALLS):
        function()
    return (time.process_time() - start) / CALLS


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 9
    steps = [
        ("JSON input", json_input_now, json_input_before),
        ("JSON result", json_result_now, json_result_before),
        ("pickled input", pickle_input_now, pickle_input_before),
    ]
    for _, now, before in steps:
        assert now() == before()
    samples = {name: ([], []) for name, _, _ in steps}
    loop = []
    for _ in range(rounds):
        loop.append(per_call(empty))
        for name, now, before in steps:
            samples[name][0].append(per_call(now))
            samples[name][1].append(per_call(before))
    print(
        f"Python {sys.version.split()[0]}; load average at end: "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; {rounds} rounds of {CALLS} calls"
    )
    overhead = statistics.median(loop)
    print(f"(loop and call overhead, not subtracted: {overhead * 1e9:.0f} ns)")
    print("| step | now: CPU per call | before: CPU per call | now / before |")
    print("|---|---:|---:|---:|")
    for name, (now, before) in samples.items():
        n, b = statistics.median(now), statistics.median(before)
        print(f"| {name} | {n * 1e9:.0f} ns | {b * 1e9:.0f} ns | {n / b:.2f} |")


if __name__ == "__main__":
    main()
