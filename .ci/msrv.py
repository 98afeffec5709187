"""Checks each workspace package's `rust-version` against its dependencies.

Only one toolchain is at hand, so the claim is checked the way cargo's own
resolver would: every package reachable through normal and build
dependencies (all features, this host's platform) must declare a
`rust-version` no newer than the workspace package's. Dev-dependencies are
not part of the claim (the test suite needs a newer toolchain; docs/development.md).

Usage: python3 .ci/msrv.py (prints one line per workspace package; exits 1
on a dependency that needs more, naming it).
"""

import json
import subprocess
import sys


def version_key(text):
    return tuple(int(part) for part in text.split("."))


def main():
    host = next(
        line.split(": ", 1)[1]
        for line in subprocess.check_output(["rustc", "-vV"], text=True).splitlines()
        if line.startswith("host: ")
    )
    metadata = json.loads(
        subprocess.check_output(
            ["cargo", "metadata", "--format-version", "1", "--locked", "--all-features",
             "--filter-platform", host],
            text=True,
        )
    )
    packages = {p["id"]: p for p in metadata["packages"]}
    nodes = {n["id"]: n for n in metadata["resolve"]["nodes"]}
    failed = False
    for member in metadata["workspace_members"]:
        package = packages[member]
        claimed = package.get("rust_version")
        if not claimed:
            print(f"{package['name']}: no rust-version", file=sys.stderr)
            failed = True
            continue
        seen, stack, needs = set(), [member], []
        while stack:
            node = nodes[stack.pop()]
            for dep in node["deps"]:
                kinds = {k["kind"] for k in dep["dep_kinds"]}
                if not kinds & {None, "build"} or dep["pkg"] in seen:
                    continue
                seen.add(dep["pkg"])
                stack.append(dep["pkg"])
                wanted = packages[dep["pkg"]].get("rust_version")
                if wanted and version_key(wanted) > version_key(claimed):
                    needs.append(f"{packages[dep['pkg']]['name']} {packages[dep['pkg']]['version']} needs {wanted}")
        highest = max(
            (packages[p].get("rust_version") or "0" for p in seen), key=version_key, default="0"
        )
        print(f"{package['name']}: rust-version {claimed}, {len(seen)} normal/build "
              f"dependencies, highest rust-version among them {highest}")
        if needs:
            failed = True
            for line in sorted(needs):
                print(f"{package['name']} claims {claimed} but {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
