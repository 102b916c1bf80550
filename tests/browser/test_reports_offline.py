"""The committed HTML reports open in Chromium with the network off: nothing is fetched, every figure shows."""
from __future__ import annotations

import pytest

from lowrank_lib import notebooks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def offline_page(request):
    from conftest import CHROMIUM, CHROMIUM_ARGS, _missing

    why = _missing()
    if why:
        pytest.skip(why)
    p = request.getfixturevalue("playwright_sync")          # the session's one Playwright (the lab tests' too)
    browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
    ctx = browser.new_context(offline=True)
    asked: list[str] = []

    def route(r):                          # every request that is not a local file is refused, and noted
        if r.request.url.startswith("file://"):
            r.continue_()
        else:
            asked.append(r.request.url)
            r.abort()

    ctx.route("**/*", route)
    page = ctx.new_page()
    page.asked = asked
    try:
        yield page
    finally:
        browser.close()


@pytest.mark.parametrize("name", notebooks.on_disk())
def test_report_renders_offline(offline_page, name):
    from lowrank_lib.notebooks.html import PANEL_NOTE

    html = notebooks.root() / "reports" / f"{name}.html"
    if not html.exists():
        pytest.fail(f"no {html} (make report, or python -m lowrank_lib.notebooks html)")
    page = offline_page
    page.asked.clear()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(html.as_uri(), wait_until="load")
    assert page.asked == [], f"{name}.html asked the network for {page.asked}"
    imgs = page.evaluate("Array.from(document.images).map(i => [i.complete, i.naturalWidth])")
    assert imgs and all(done and w > 0 for done, w in imgs), f"{name}.html: images not drawn: {imgs}"
    text = page.locator("body").text_content() or ""
    assert "Error displaying widget" not in text and not errors, errors
    title = page.title()
    assert title and title != "Notebook", title
    src = (notebooks.notebooks_dir() / f"{name}.ipynb").read_text()
    if "SliderPanel" in src or ".panel(" in src or "head_explorer(" in src:
        assert PANEL_NOTE.split(":")[0] in text, f"{name}.html: the slider panel's note is missing"


def test_index_links_every_report(offline_page):
    index = notebooks.root() / "reports" / "index.html"
    assert index.exists(), "no reports/index.html (make report)"
    page = offline_page
    page.goto(index.as_uri(), wait_until="load")
    links = page.evaluate("Array.from(document.querySelectorAll('a')).map(a => a.getAttribute('href'))")
    for name in notebooks.on_disk():
        assert f"{name}.html" in links, f"index.html does not link {name}.html"
    assert page.locator("td ul li").count() >= len(notebooks.on_disk())


def test_the_offline_page_sees_a_network_request(offline_page, tmp_path):
    """The check above can fail: a page that loads a script from a CDN is caught."""
    page = tmp_path / "cdn.html"
    page.write_text('<html><head><script src="https://cdn.jsdelivr.net/npm/x/dist/x.js"></script></head>'
                    "<body>x</body></html>")
    offline_page.asked.clear()
    offline_page.goto(page.as_uri(), wait_until="load")
    assert offline_page.asked == ["https://cdn.jsdelivr.net/npm/x/dist/x.js"]
