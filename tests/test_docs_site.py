"""The documentation site: it builds with warnings as errors, its generated pages say what the code says, and a
real browser shows it.

* The CLI page is generated from the parser (``tools/docs_hooks.py``): it must hold exactly what
  ``dml-optim --help`` and each ``dml-optim COMMAND --help`` print.
* The API page has one entry per name of ``dml_optim.__all__``, and each of those has a docstring.
* Each optimizer page's argument table lists every argument of the constructor.
* ``mkdocs build --strict`` (broken links and anchors, pages missing from the nav, unresolved references,
  a public name without a docstring) succeeds; the built pages hold the generated parts.
* The built site, served on 127.0.0.1, opens in headless Chromium (Playwright driving Debian's
  ``/usr/bin/chromium``): the home page, an optimizer page and the API page load without console errors,
  the navigation reaches every page of the nav, and the search finds ``AdamW``.  Skipped, with the reason,
  where no browser is installed.
"""

from __future__ import annotations

import contextlib
import functools
import html
import http.server
import inspect
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

import dml_optim
from dml_optim.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import docs_hooks  # noqa: E402

CHROMIUM = Path("/usr/bin/chromium")


def _nav_pages() -> list[str]:
    """The pages of ``mkdocs.yml``'s nav, in order (``docs/``-relative paths)."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))

    def walk(items):
        for item in items:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            yield from walk(value) if isinstance(value, list) else [value]

    return list(walk(config["nav"]))


def _url(page: str) -> str:
    """The site URL path of a nav page (``use_directory_urls``): ``guide/options.md`` -> ``guide/options/``."""
    stem = page.removesuffix(".md")
    return "" if stem == "index" else stem.removesuffix("/index") + "/"


def _text(path: Path) -> str:
    """A built page's text: tags dropped, entities decoded."""
    return html.unescape(re.sub(r"<[^>]+>", "", path.read_text(encoding="utf-8")))


# -- the generated parts, without a build ---------------------------------------------------------------------


def test_the_nav_holds_every_page():
    pages = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md"))
    assert sorted(_nav_pages()) == pages


@pytest.mark.slow
def test_the_cli_page_is_what_the_command_prints(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", str(docs_hooks.HELP_COLUMNS))
    helps = docs_hooks.command_helps()
    assert list(helps) == ["", *COMMANDS]
    page = docs_hooks.cli_markdown()
    for name, text in helps.items():
        with pytest.raises(SystemExit) as done:  # what the console script dml-optim runs: dml_optim.cli:main
            main([*filter(None, [name]), "--help"])
        assert done.value.code == 0
        printed = capsys.readouterr().out
        assert printed == text, name
        assert f"$ {f'dml-optim {name}'.strip()} --help\n{printed.rstrip()}\n```" in page, name
    # the installed command itself prints the page's top-level help
    command = shutil.which("dml-optim", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))
    argv = [command] if command else [sys.executable, "-m", "dml_optim"]
    proc = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": str(docs_hooks.HELP_COLUMNS)})
    assert proc.returncode == 0 and proc.stdout == helps[""], proc.stderr
    assert "<!-- GENERATED: cli -->" in (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")


def test_every_public_name_is_on_the_api_page_with_a_docstring():
    entries = docs_hooks.api_markdown()
    assert [line for line in entries.splitlines() if line] == [f"::: dml_optim.{name}" for name in dml_optim.__all__]
    assert "<!-- GENERATED: api -->" in (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    missing = docs_hooks.missing_docstrings()
    assert set(missing) <= set(docs_hooks.KNOWN_MISSING), f"public names without a docstring: {missing}"
    assert set(docs_hooks.KNOWN_MISSING) <= set(missing), "a name of KNOWN_MISSING has a docstring now: remove it"


def test_the_docstring_check_reads_hash_colon_comments_and_fails_the_build(monkeypatch, caplog):
    package = docs_hooks.load_package()
    registry = package["OPTIMIZERS"].final_target
    assert registry.docstring.value.startswith("Registry name")  # from its `#:` comment
    monkeypatch.setattr(docs_hooks, "missing_docstrings", lambda: ["device", "__version__"])
    monkeypatch.setattr(docs_hooks, "KNOWN_MISSING", {"__version__": "known: does not fail the build"})
    with caplog.at_level("WARNING", logger="mkdocs.plugins.dml_optim"):
        docs_hooks.on_config({})
    assert [r.getMessage() for r in caplog.records] == [
        "dml_optim.device is public (dml_optim.__all__) and has no docstring"]


@pytest.mark.parametrize("name", sorted(cls.__name__ for cls in dml_optim.OPTIMIZERS.values()))
def test_each_optimizer_page_lists_every_argument(name):
    pages = {p.name: p.read_text(encoding="utf-8") for p in (ROOT / "docs" / "optimizers").glob("*.md")}
    (page,) = [text for text in pages.values() if f"<!-- GENERATED: arguments {name} -->" in text]
    assert "## Formula" in page and "## torch twin" in page and "```python" in page
    table = docs_hooks.arguments_markdown(name)
    for param in inspect.signature(getattr(dml_optim, name)).parameters.values():
        shown = f"**{param.name}" if param.kind is param.VAR_KEYWORD else param.name
        assert f"| `{shown}` |" in table, param.name


# -- the strict build and the browser ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built with ``mkdocs build --strict`` into a temporary folder."""
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stderr[-4000:]}"
    assert "WARNING" not in proc.stderr, proc.stderr
    return out


@pytest.mark.slow
def test_the_strict_build_holds_the_generated_pages(site):
    for page in _nav_pages():
        assert (site / _url(page) / "index.html").is_file(), page
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    for name in dml_optim.__all__:
        assert f'id="dml_optim.{name}"' in api, name
    cli = _text(site / "cli" / "index.html")
    helps = docs_hooks.command_helps()
    for text in helps.values():
        assert text.rstrip() in cli
    adam = _text(site / "optimizers" / "adam" / "index.html")
    assert "norm_coefficient_post" in adam and "betas[0]" in adam


@contextlib.contextmanager
def _served(folder: Path):
    """``folder`` served over HTTP on 127.0.0.1 (an ephemeral port) while the block runs; yields the base URL."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):  # noqa: D102 - no access log in the test output
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def _browser_missing() -> str | None:
    """Why the browser check cannot run here, or None."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright is not installed (pip install -e \".[docs]\")"
    if not CHROMIUM.exists():
        return f"no Chromium at {CHROMIUM} (Debian: apt-get install chromium)"
    return None


@pytest.mark.slow
def test_the_site_in_a_real_browser(site):
    reason = _browser_missing()
    if reason:
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with _served(site) as base, sync_playwright() as playwright:
        # --no-sandbox: Chromium refuses to start as root with its sandbox (CI runs as root)
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("console", lambda message: errors.append(f"{page.url}: {message.text}")
                    if message.type == "error" else None)
            page.on("pageerror", lambda error: errors.append(f"{page.url}: {error}"))
            for path in ("", "optimizers/adamw/", "api/"):  # load without console errors
                response = page.goto(base + path, wait_until="load")
                assert response.status == 200, path
                page.wait_for_selector("nav.md-nav--primary")
                assert page.title().endswith("dml-optim"), page.title()
            assert errors == [], errors
            assert page.locator('[id="dml_optim.AdamW"]').count() == 1
            # the navigation, followed from the home page, reaches every page of the nav
            wanted = {base + _url(p) for p in _nav_pages()}
            seen, queue = set(), [base]
            while queue:
                url = queue.pop()
                if url in seen:
                    continue
                seen.add(url)
                assert page.goto(url, wait_until="domcontentloaded").status == 200, url
                links = page.eval_on_selector_all("nav.md-nav--primary a.md-nav__link[href]",
                                                  "links => links.map(a => a.href.split('#')[0])")
                queue.extend(link for link in links if link.startswith(base) and link not in seen)
            assert wanted <= seen, sorted(wanted - seen)
            assert errors == [], errors
            # the site's search finds AdamW
            page.goto(base, wait_until="load")
            page.fill("input.md-search__input", "AdamW")
            page.wait_for_selector(".md-search-result__item", timeout=20_000)
            results = page.inner_text(".md-search-result__list")
            assert "AdamW" in results, results
            assert errors == [], errors
        finally:
            browser.close()
