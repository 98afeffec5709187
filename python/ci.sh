#!/usr/bin/env bash
# Builds the callreg wheel (abi3: one wheel for CPython 3.10+, built once
# per checkout), installs it into a fresh venv of PYTHON with
# CLOUDPICKLE_SPEC (default: the latest cloudpickle), pytest, ruff and
# mypy, and runs ruff, mypy --strict on the package, stubtest (the
# package's types against the installed wheel), the package's tests and
# examples/tree.py. Usage: python/ci.sh PYTHON [CLOUDPICKLE_SPEC]
set -euo pipefail
shopt -s globstar
python="${1:?usage: python/ci.sh PYTHON [CLOUDPICKLE_SPEC]}"
cloudpickle="${2:-cloudpickle}"
here="$(cd "$(dirname "$0")" && pwd)"
work="${CALLREG_CI_DIR:-$here/target/ci}"
mkdir -p "$work"

# The wheel: built once with maturin from a venv of its own (maturin,
# auditwheel and ziglang pinned exactly; the venv is rebuilt when a pin
# changes) and reused by every later run in this checkout unless its
# sources changed (the README too: it is the wheel's description).
# It is linked with zig against glibc 2.28 (--zig --compatibility
# manylinux_2_28), not against this machine's glibc, so that it installs
# on RHEL 8, Debian 11, Ubuntu 20.04 and newer; auditwheel must agree
# that it is manylinux_2_28.
maturin_pin='maturin==1.16.0'
auditwheel_pin='auditwheel==6.8.2'
ziglang_pin='ziglang==0.17.1'
manylinux='manylinux_2_28'
stamp="$(cd "$here/.." && cat Cargo.toml Cargo.lock src/**/*.rs src/*.rs python/Cargo.toml python/Cargo.lock python/pyproject.toml python/README.md python/src/*.rs python/callreg/*.py python/callreg/*.pyi python/callreg/py.typed 2>/dev/null | sha256sum | cut -c1-16)"
wheels="$work/wheels-$stamp"
builder="$work/build-venv"
if ! compgen -G "$wheels/callreg-*.whl" >/dev/null; then
  if [ "$(cat "$builder/pins" 2>/dev/null)" != "$maturin_pin $auditwheel_pin $ziglang_pin" ]; then
    rm -rf "$builder"
    python3 -m venv "$builder"
    "$builder/bin/pip" install --quiet --disable-pip-version-check "$maturin_pin" "$auditwheel_pin" "$ziglang_pin"
    echo "$maturin_pin $auditwheel_pin $ziglang_pin" >"$builder/pins"
  fi
  # maturin finds zig as the venv's ziglang module (PATH: the venv first).
  PATH="$builder/bin:$PATH" "$builder/bin/maturin" build --release --quiet --zig --compatibility "$manylinux" \
    --manifest-path "$here/Cargo.toml" -o "$wheels.tmp"
  mv "$wheels.tmp" "$wheels"
fi
wheel="$(ls "$wheels"/callreg-*.whl | head -n1)"
# A manylinux_2_28 wheel: its file name's platform tag says so, and
# auditwheel finds it consistent with a manylinux tag no newer than that.
"$builder/bin/python" - "$wheel" "$("$builder/bin/auditwheel" show "$wheel" 2>&1)" "$manylinux" <<'PY'
import re, sys
wheel, report, wanted = sys.argv[1], " ".join(sys.argv[2].split()), sys.argv[3]
tag = re.fullmatch(r".*-(manylinux_(\d+)_(\d+)_\w+)\.whl", wheel)
found = re.search(r'consistent with the following platform tag: "(manylinux_(\d+)_(\d+)_\w+)"', report)
if tag is None or found is None or tuple(map(int, found.groups()[1:])) > tuple(map(int, tag.groups()[1:])):
    sys.exit("not a manylinux wheel: %s\nauditwheel show: %s" % (wheel, report))
if not tag.group(1).startswith(wanted + "_"):
    sys.exit("the wheel is %s, not %s: it would not install on older glibc" % (tag.group(1), wanted))
print("wheel %s: auditwheel finds it consistent with %s" % (wheel.rsplit("/", 1)[-1], found.group(1)))
PY

version="$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
venv="$work/venv-$version-$(printf '%s' "$cloudpickle" | tr -c 'A-Za-z0-9.' '_')"
rm -rf "$venv"
# Removed when this run ends, passed or failed: CI runs one per interpreter
# and each holds a few hundred MB (numpy, distributed, mypy). Set
# CALLREG_CI_KEEP_VENV=1 to keep it for a look afterwards.
if [ -z "${CALLREG_CI_KEEP_VENV:-}" ]; then
  trap 'rm -rf "$venv"' EXIT
fi
"$python" -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check "$cloudpickle" pytest 'mypy==2.4.1' 'ruff==0.17.6'
"$venv/bin/pip" install --quiet --disable-pip-version-check "$wheel"
# callreg.dask's tests need distributed, which needs cloudpickle 3 or later:
# installed with the latest cloudpickle only (elsewhere they are skipped).
# The shared-buffer tests of numpy arrays need numpy: installed there too.
if [ "$cloudpickle" = cloudpickle ]; then
  "$venv/bin/pip" install --quiet --disable-pip-version-check 'distributed==2026.8.0' 'numpy>=1.26'
  # callreg.joblib's tests: joblib needs cloudpickle 3 or later too.
  "$venv/bin/pip" install --quiet --disable-pip-version-check 'joblib==1.6.0'
fi
echo "callreg python tests: CPython $version, $("$venv/bin/python" -c 'import cloudpickle; print("cloudpickle", cloudpickle.__version__)')"
# Lint and format of the package, its tests, benchmarks and tools (python/pyproject.toml).
(cd "$here" && "$venv/bin/ruff" check callreg tests benchmarks tools && "$venv/bin/ruff" format --check callreg tests benchmarks tools)
# The package's types, strictly (its sources, with callreg/_callreg.pyi for
# the extension; the settings are python/pyproject.toml's).
(cd "$here" && "$venv/bin/mypy" --strict --cache-dir "$work/mypy-cache" -p callreg)
# From outside the source tree, so `import callreg` is the installed wheel.
cd "$work"
# The types agree with what the installed wheel has at run time (the
# extension's stub included); python/stubtest-allowlist.txt says why each
# entry it has is no disagreement.
allowlists=(--allowlist "$here/stubtest-allowlist.txt")
if "$venv/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 13))'; then
  allowlists+=(--allowlist "$here/stubtest-allowlist-3.13.txt")
fi
if ! "$venv/bin/python" -c 'import distributed' 2>/dev/null; then
  allowlists+=(--allowlist "$here/stubtest-allowlist-nodask.txt")
fi
if "$venv/bin/python" -c 'import joblib' 2>/dev/null; then
  allowlists+=(--allowlist "$here/stubtest-allowlist-joblib.txt")
else
  allowlists+=(--allowlist "$here/stubtest-allowlist-nojoblib.txt")
fi
"$venv/bin/python" -m mypy.stubtest --mypy-config-file "$here/pyproject.toml" "${allowlists[@]}" callreg
"$venv/bin/pytest" -q -p no:cacheprovider "$here/tests"
# CPython's own concurrent.futures process-pool tests against
# callreg.Executor, beside ProcessPoolExecutor as the control, on the
# interpreters that ship the suite (3.10's module, 3.13's package); fails
# on a test that passes for ProcessPoolExecutor and fails for callreg
# outside the tool's documented list (python/tools/cpython_futures_suite.py,
# docs/migrating.md). Once per interpreter (not again for the oldest
# cloudpickle). Each run's counts are in the log.
if [ "$cloudpickle" = cloudpickle ] && "$venv/bin/python" -c 'import test.test_concurrent_futures' 2>/dev/null; then
  "$venv/bin/python" "$here/tools/cpython_futures_suite.py" --test-timeout 300 --log-dir "$work/cpython-suite-$version"
fi
# loky's own ProcessPoolExecutor tests (from its sdist, downloaded once per
# checkout into $work/loky-sdist: its wheel has none) against
# callreg.Executor, beside loky's executor as the control; fails on a test
# that passes for loky and fails for callreg outside the tool's documented
# list (python/tools/loky_suite.py, docs/migrating.md). Once: on the main
# interpreter (python3's version, as .ci/run picks it) with the latest
# cloudpickle. loky's forkserver start method with the control, then loky's
# own (callreg's fork) for callreg alone (every callreg failure outside the
# list counts); not spawn, which callreg runs as forkserver. About 3 minutes.
if [ "$cloudpickle" = cloudpickle ] && [ "$version" = "$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')" ]; then
  # psutil: the suite's process checks; tblib: its test of exception causes.
  "$venv/bin/pip" install --quiet --disable-pip-version-check 'loky==3.7.0' psutil tblib
  "$venv/bin/python" "$here/tools/loky_suite.py" --cache "$work/loky-sdist" --start-method forkserver \
    --log-dir "$work/loky-suite-$version"
  "$venv/bin/python" "$here/tools/loky_suite.py" --cache "$work/loky-sdist" --start-method loky --executor callreg \
    --log-dir "$work/loky-suite-$version"
fi
# The README's tree example, with the installed wheel; its last line
# checks its own result.
"$venv/bin/python" "$here/../examples/tree.py" | tee "$work/tree-example.out"
grep -qx 'sum of cubes below 100: 24502500 True' "$work/tree-example.out"
