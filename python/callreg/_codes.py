"""Where the code of registered callables was defined, so that a task's
remote traceback names the file and source line of each frame of code
pickled by value."""

from __future__ import annotations

import functools
import linecache
import re
import threading
import types
from typing import Any

# What the registry follows: functions, and the partials and methods
# that hold one.
_RECORDED: tuple[type, ...] = (types.FunctionType, functools.partial, types.MethodType)


class CodeRegistry:
    """Where the code of registered callables was defined: the parent
    records the code objects of each callable it packs (and of the
    functions it refers to by global name, pickled with it), so that a
    target's traceback frames of code pickled by value (file
    ``<dynamic-code>`` with cloudpickle 3.1 and later) name their file
    and show their source line as this process reads them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # function name -> [(first line, last line, file)]
        self.spans: dict[str, list[tuple[int, int, str]]] = {}

    def record(self, fn: object) -> None:
        seen: set[int] = set()
        stack: list[Any] = [fn]
        budget = 256
        while stack and budget:
            budget -= 1
            obj = stack.pop()
            # By type: no attribute of a callable object is read (its
            # class's __getattr__ could raise or add what it is asked).
            if isinstance(obj, functools.partial):
                stack.append(obj.func)
                continue
            if isinstance(obj, types.MethodType):
                stack.append(obj.__func__)
                continue
            if not isinstance(obj, types.FunctionType):
                continue
            code = obj.__code__
            if id(code) in seen:
                continue
            seen.add(id(code))
            self._record_code(code, seen)
            names = obj.__globals__
            referred = [names.get(name) for name in code.co_names]
            for cell in obj.__closure__ or ():
                try:
                    referred.append(cell.cell_contents)
                except ValueError:  # an empty cell
                    pass
            stack.extend(value for value in referred if isinstance(value, _RECORDED))

    def _record_code(self, code: types.CodeType, seen: set[int]) -> None:
        codes = [code]
        while codes:
            code = codes.pop()
            lines = [line for _, _, line in code.co_lines() if line is not None]
            if lines and not code.co_filename.startswith("<"):
                span = (min(lines + [code.co_firstlineno]), max(lines), code.co_filename)
                with self.lock:
                    spans = self.spans.setdefault(code.co_name, [])
                    if span not in spans:
                        spans.append(span)
                        del spans[:-8]
            for const in code.co_consts:
                if isinstance(const, types.CodeType) and id(const) not in seen:
                    seen.add(id(const))
                    codes.append(const)

    def file_of(self, name: str, line: int) -> str | None:
        with self.lock:
            spans = list(self.spans.get(name, ()))
        found = [path for first, last, path in spans if first <= line <= last]
        return found[0] if len(set(found)) == 1 else None

    def render(self, text: str) -> str:
        """``text`` (a formatted traceback) with each ``<dynamic-code>``
        frame of a recorded callable given its file and source line."""
        if '"<dynamic-code>"' not in text:
            return text
        out = []
        for line in text.splitlines(keepends=True):
            match = _DYNAMIC_FRAME.match(line)
            if match is not None:
                number, name = int(match.group(1)), match.group(2)
                path = self.file_of(name, number)
                if path is not None:
                    out.append('  File "%s", line %d, in %s\n' % (path, number, name))
                    source = linecache.getline(path, number).strip()
                    if source:
                        out.append("    %s\n" % source)
                    continue
            out.append(line)
        return "".join(out)


_DYNAMIC_FRAME = re.compile(r'^  File "<dynamic-code>", line (\d+), in (.+)$')

CODES = CodeRegistry()
"""The code registry of this process (every Worker's and Executor's)."""
