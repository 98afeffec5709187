"""Where the code of registered callables was defined, so that a task's
remote traceback names the file and source line of each frame of code
pickled by value."""

from __future__ import annotations

import linecache
import re
import threading
import types
from typing import Any


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
            code = getattr(obj, "__code__", None)
            if code is None:
                func = getattr(obj, "func", None) or getattr(obj, "__func__", None)  # partial, method
                if func is not None:
                    stack.append(func)
                continue
            if id(code) in seen:
                continue
            seen.add(id(code))
            self._record_code(code, seen)
            names = getattr(obj, "__globals__", {})
            referred = [names.get(name) for name in code.co_names]
            for cell in getattr(obj, "__closure__", None) or ():
                try:
                    referred.append(cell.cell_contents)
                except ValueError:  # an empty cell
                    pass
            for value in referred:
                if callable(value) and hasattr(value, "__code__"):
                    stack.append(value)

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
