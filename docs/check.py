"""Checks the built documentation site: the quickstart page, opened in
headless Chromium, renders its first code block inside <pre><code>, and
no link or resource of any built page (404.html aside) is absolute or
broken (its file exists; a #fragment names an id of that page).

Usage: python docs/check.py [SITE_DIR]. Without SITE_DIR it first builds
the site (``mkdocs build --strict``, with the mkdocs of this interpreter)
into a temporary directory. Needs ``chromium`` on PATH (Debian's
``chromium`` package). Exits 1 naming every failure."""

import html.parser
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.parse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Page(html.parser.HTMLParser):
    """A page's links, resources, ids and the text of its <pre><code> blocks."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.refs = []
        self.ids = set()
        self.code_blocks = []
        self._pre = 0
        self._code = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for name in ("href", "src"):
            if attrs.get(name):
                self.refs.append(attrs[name])
        for name in ("id", "name"):
            if attrs.get(name):
                self.ids.add(attrs[name])
        if tag == "pre":
            self._pre += 1
        elif tag == "code" and self._pre and self._code is None:
            self._code = []

    def handle_endtag(self, tag):
        if tag == "code" and self._code is not None:
            self.code_blocks.append("".join(self._code))
            self._code = None
        elif tag == "pre" and self._pre:
            self._pre -= 1

    def handle_data(self, data):
        if self._code is not None:
            self._code.append(data)


def parse(text):
    page = Page()
    page.feed(text)
    page.close()
    return page


def first_code_block(markdown_path):
    """The lines of the first fenced code block of a Markdown page."""
    with open(markdown_path, encoding="utf-8") as f:
        found = re.search(r"^```[^\n]*\n(.*?)^```", f.read(), re.MULTILINE | re.DOTALL)
    if found is None:
        sys.exit("%s has no code block" % markdown_path)
    return [line.rstrip() for line in found.group(1).splitlines() if line.strip()]


def check_rendered_code(site, failures):
    """Headless Chromium renders the quickstart page's code block."""
    page = os.path.join(site, "quickstart", "index.html")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        failures.append("chromium is not installed (Debian: apt-get install chromium)")
        return
    with tempfile.TemporaryDirectory() as profile:
        done = subprocess.run(
            [
                chromium,
                "--headless",
                "--no-sandbox",  # CI runs as root
                "--disable-gpu",
                "--user-data-dir=" + profile,
                "--dump-dom",
                "file://" + page,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    if done.returncode != 0 or "<html" not in done.stdout:
        failures.append("chromium could not render %s (exit %d): %s" % (page, done.returncode, done.stderr[-2000:]))
        return
    blocks = parse(done.stdout).code_blocks
    expected = first_code_block(os.path.join(ROOT, "docs", "quickstart.md"))
    for block in blocks:
        lines = [line.rstrip() for line in block.splitlines()]
        if all(line in lines for line in expected):
            print("quickstart: Chromium renders its code block (%d lines) in <pre><code>" % len(expected))
            return
    failures.append(
        "quickstart: no <pre><code> of the page Chromium rendered holds its first code block %r (blocks: %r)"
        % (expected, blocks)
    )


def check_links(site, failures):
    """Every relative href/src of every built page resolves to a file, and
    its fragment to an id of that page."""
    pages = {}
    for directory, _, files in os.walk(site):
        for name in files:
            # 404.html links from the site's root on purpose: a server
            # shows it for a missing page at any depth.
            if name.endswith(".html") and os.path.join(directory, name) != os.path.join(site, "404.html"):
                path = os.path.join(directory, name)
                with open(path, encoding="utf-8") as f:
                    pages[os.path.normpath(path)] = parse(f.read())
    checked = 0
    for path, page in sorted(pages.items()):
        for ref in page.refs:
            parts = urllib.parse.urlsplit(ref)
            if parts.scheme or parts.netloc:
                continue  # an external link or a data: URL
            where = os.path.relpath(path, site)
            if ref.startswith("/"):
                failures.append("%s: absolute link %r (the site must work from any directory)" % (where, ref))
                continue
            target = path
            if parts.path:
                target = os.path.normpath(os.path.join(os.path.dirname(path), urllib.parse.unquote(parts.path)))
                if os.path.isdir(target):
                    target = os.path.join(target, "index.html")
            checked += 1
            if not os.path.isfile(target):
                failures.append("%s: broken link %r (no %s)" % (where, ref, os.path.relpath(target, site)))
                continue
            fragment = urllib.parse.unquote(parts.fragment)
            if fragment and target in pages and fragment not in pages[target].ids:
                failures.append(
                    "%s: link %r names no id %r of %s" % (where, ref, fragment, os.path.relpath(target, site))
                )
    print("links: %d relative links and resources of %d pages checked" % (checked, len(pages)))


def main():
    failures = []
    if len(sys.argv) > 1:
        site = os.path.abspath(sys.argv[1])
        check_links(site, failures)
        check_rendered_code(site, failures)
    else:
        with tempfile.TemporaryDirectory() as site:
            env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
            subprocess.run(
                [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", site],
                cwd=ROOT,
                env=env,
                check=True,
            )
            check_links(site, failures)
            check_rendered_code(site, failures)
    for failure in failures:
        print("FAILED:", failure, file=sys.stderr)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
