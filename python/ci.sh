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

# The wheel: built once with maturin from a venv of its own (maturin and
# auditwheel pinned exactly; the venv is rebuilt when a pin changes) and
# reused by every later run in this checkout unless its sources changed
# (the README too: it is the wheel's description).
# maturin tags it manylinux_2_X from the glibc symbols the module uses
# (its default auto detection); auditwheel must agree that it is.
maturin_pin='maturin==1.16.0'
auditwheel_pin='auditwheel==6.8.2'
stamp="$(cd "$here/.." && cat Cargo.toml Cargo.lock src/**/*.rs src/*.rs python/Cargo.toml python/Cargo.lock python/pyproject.toml python/README.md python/src/*.rs python/callreg/*.py python/callreg/*.pyi python/callreg/py.typed 2>/dev/null | sha256sum | cut -c1-16)"
wheels="$work/wheels-$stamp"
builder="$work/build-venv"
if ! compgen -G "$wheels/callreg-*.whl" >/dev/null; then
  if [ "$(cat "$builder/pins" 2>/dev/null)" != "$maturin_pin $auditwheel_pin" ]; then
    rm -rf "$builder"
    python3 -m venv "$builder"
    "$builder/bin/pip" install --quiet --disable-pip-version-check "$maturin_pin" "$auditwheel_pin"
    echo "$maturin_pin $auditwheel_pin" >"$builder/pins"
  fi
  "$builder/bin/maturin" build --release --quiet --manifest-path "$here/Cargo.toml" -o "$wheels.tmp"
  mv "$wheels.tmp" "$wheels"
fi
wheel="$(ls "$wheels"/callreg-*.whl | head -n1)"
# A manylinux wheel: its file name's platform tag is manylinux_2_X, and
# auditwheel finds it consistent with a manylinux tag no newer than that.
"$builder/bin/python" - "$wheel" "$("$builder/bin/auditwheel" show "$wheel" 2>&1)" <<'PY'
import re, sys
wheel, report = sys.argv[1], " ".join(sys.argv[2].split())
tag = re.fullmatch(r".*-(manylinux_(\d+)_(\d+)_\w+)\.whl", wheel)
found = re.search(r'consistent with the following platform tag: "(manylinux_(\d+)_(\d+)_\w+)"', report)
if tag is None or found is None or tuple(map(int, found.groups()[1:])) > tuple(map(int, tag.groups()[1:])):
    sys.exit("not a manylinux wheel: %s\nauditwheel show: %s" % (wheel, report))
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
# The README's tree example, with the installed wheel; its last line
# checks its own result.
"$venv/bin/python" "$here/../examples/tree.py" | tee "$work/tree-example.out"
grep -qx 'sum of cubes below 100: 24502500 True' "$work/tree-example.out"
