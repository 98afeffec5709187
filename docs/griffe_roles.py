"""A griffe extension for the API reference (mkdocs.yml): the package's
docstrings are written with Sphinx roles (``:class:`Worker```,
``:meth:`Worker.start```) and ``::`` before literal blocks. This turns a
role naming a documented object of ``callreg`` into a cross-reference
(``[`Worker`][callreg.Worker]``), any other role into inline code, and a
paragraph's closing ``::`` into ``:`` (the indented block after it is
already a code block in Markdown)."""

import re

import griffe

ROLE = re.compile(r":(?:class|meth|func|attr|data|exc|mod):`~?([^`]+)`")
LITERAL_MARK = re.compile(r"(\S)::$", re.MULTILINE)


class SphinxRoles(griffe.Extension):
    """Rewrites the docstrings of the ``callreg`` package once it is loaded."""

    def on_package(self, *, pkg, **kwargs):
        if pkg.name != "callreg":
            return
        for obj in _walk(pkg):
            if obj.docstring is not None:
                obj.docstring.value = _rewrite(obj.docstring.value, pkg)


def _walk(obj):
    yield obj
    for member in obj.members.values():
        if member.is_alias:
            continue
        yield from _walk(member)


def _documented(pkg, path):
    """Whether ``callreg.<path>`` is a class, function or method the API
    reference renders (a public name of the package, or a public member of
    one of its classes)."""
    parts = path.split(".")
    if parts[0] not in {str(name) for name in pkg.exports or ()}:
        return False
    if any(part.startswith("_") for part in parts[1:]):
        return False
    try:
        found = pkg[path]
    except (KeyError, griffe.AliasResolutionError):
        return False
    if found.is_alias:
        try:
            found = found.final_target
        except griffe.AliasResolutionError:
            return False
    return len(parts) == 1 or found.is_function


def _rewrite(text, pkg):
    def role(match):
        name = match.group(1).strip()
        path = name[len("callreg.") :] if name.startswith("callreg.") else name
        if _documented(pkg, path):
            return "[`%s`][callreg.%s]" % (name, path)
        return "`%s`" % name

    return LITERAL_MARK.sub(r"\1:", ROLE.sub(role, text))
