"""JupyterLab in a real browser: ONE server on 127.0.0.1 over a temporary copy of every notebook, Debian's Chromium.

The copies are prepared with papermill's parameter injection (``lowrank_lib.notebooks.prepare``, the CI
parameters of ``notebooks/params/ci.yaml``), which is how a person gets the CI-sized notebook:
``python -m lowrank_lib.notebooks prepare NAME DIR``, then open it in JupyterLab. With
``LOWRANK_LIB_BROWSER_PARAMS=defaults`` the copies keep the notebooks' own (report) parameters instead: the
idle-machine timing run (``tests/browser/README.md``). Playwright's Python package drives ``/usr/bin/chromium``
(never ``playwright install``); without either the tests skip and say why.

Everything runs with fresh state: Jupyter config/data/runtime/settings/workspace dirs, IPython dir and the
Chromium profile all live in the test's temporary directory; the JupyterLab *app* settings are the
environment's (``python -m lowrank_lib.notebooks lab-settings``: widget state saved with the notebook, what
``make setup`` installs). The server gets a random token and a free port; figures that fail
``lowrank_lib.figures.check`` raise in the kernels (``LOWRANK_LIB_FIGURE_CHECK=error``).
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("LOWRANK_LIB_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
#: every wait for a notebook's output scales with this (a loaded 2-core machine is slow; the default is generous)
SLOW = float(os.environ.get("LOWRANK_LIB_BROWSER_SLOW", "1"))
#: "ci" (default): the CI parameters; "defaults": the notebooks' own parameters (the report-size timing run)
PARAMS = os.environ.get("LOWRANK_LIB_BROWSER_PARAMS", "ci")


def _missing() -> str | None:
    if not (Path(CHROMIUM).exists() and os.access(CHROMIUM, os.X_OK)):
        return (f"Chromium not found at {CHROMIUM} (Debian: apt-get install -y chromium; .ci/run installs it; "
                f"LOWRANK_LIB_CHROMIUM points elsewhere)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright's Python package is not installed (pip install -e '.[browser]'; never `playwright install`)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Timings:
    """Named durations measured by the browser tests, printed at the end of the session."""

    rows: list[tuple[str, float]] = []

    @classmethod
    def add(cls, name: str, seconds: float):
        cls.rows.append((name, seconds))
        print(f"[browser timing] {name}: {seconds:.1f} s", flush=True)


@pytest.fixture(scope="session")
def lab_server(tmp_path_factory):
    """``(base_url, token, notebook_dir)`` of a JupyterLab serving prepared copies of every notebook."""
    why = _missing()
    if why:
        pytest.skip(why)
    from lowrank_lib import notebooks

    tmp = tmp_path_factory.mktemp("lab")
    nbdir = tmp / "work"
    settings_file = notebooks.install_lab_settings()     # what `make setup` installs; idempotent
    assert json.loads(settings_file.read_text()) == notebooks.LAB_SETTINGS
    for name in notebooks.on_disk():
        if PARAMS == "defaults":
            nbdir.mkdir(parents=True, exist_ok=True)
            shutil.copy(notebooks.notebooks_dir() / f"{name}.ipynb", nbdir / f"{name}.ipynb")
        else:
            notebooks.prepare(name, nbdir, ci=True)
    settings = tmp / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    # a fresh user who said "no" to news and update checks (nothing may reach the network)
    (settings / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false",
                                                                           "checkForUpdates": False}))
    from lowrank_lib.figures import CHECK_ENV

    env = {k: v for k, v in os.environ.items() if k not in ("MPLBACKEND", "JUPYTER_PATH", "JUPYTER_CONFIG_PATH")}
    env[CHECK_ENV] = "error"
    env.update(JUPYTER_CONFIG_DIR=str(tmp / "config"), JUPYTER_DATA_DIR=str(tmp / "data"),
               JUPYTER_RUNTIME_DIR=str(tmp / "runtime"), JUPYTERLAB_SETTINGS_DIR=str(tmp / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"), IPYTHONDIR=str(tmp / "ipython"),
               PYTHONPATH=os.pathsep.join(p for p in [str(notebooks.root()), os.environ.get("PYTHONPATH", "")] if p))
    port, token = _free_port(), secrets.token_hex(24)
    log = open(tmp / "server.log", "w")
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
           "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={nbdir}",
           "--ServerApp.allow_root=True", "--LabApp.news_url=None", "--LabApp.extension_manager=readonly",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=nbdir)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120 * SLOW
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"jupyter lab exited with {proc.returncode}:\n{(tmp / 'server.log').read_text()[-3000:]}")
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if time.time() > deadline:
                    pytest.fail(f"jupyter lab did not answer in time:\n{(tmp / 'server.log').read_text()[-3000:]}")
                time.sleep(0.5)
        yield base, token, nbdir
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


class Lab:
    """One Chromium page on the JupyterLab server, with the few gestures the tests need."""

    def __init__(self, page, base: str, token: str, nbdir: Path):
        self.base, self.token, self.nbdir = base, token, nbdir
        self.console: list[str] = []
        self._watch(page)

    def _watch(self, page):
        self.page = page
        page.on("console", lambda m: self.console.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: self.console.append(f"pageerror: {e}"))

    def new_page(self):
        """Close this page, stop every kernel, and continue on a fresh page with no saved workspace: a person
        opening the saved notebook again later."""
        context = self.page.context
        self.page.close()
        self.shutdown_kernels()
        self.console.clear()
        self._watch(context.new_page())
        self.reset_workspaces()

    def open(self, name: str):
        """Open ``name`` as the only document of the page. JupyterLab restores its saved workspace beside a
        /tree URL, so the notebook of an earlier test would come back as a second tab (and could be the one
        Run All runs: seen in CI). The ``lab`` fixture deletes the saved workspaces first; this checks it."""
        self.page.goto(f"{self.base}/lab/tree/{name}.ipynb?token={self.token}")
        self.page.locator(".jp-NotebookPanel .jp-Cell").first.wait_for(timeout=120_000 * SLOW)
        current = self.page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current .lm-TabBar-tabLabel")
        deadline = time.time() + 60 * SLOW
        label = f"{Path(name).name}.ipynb"                  # a copy in a subfolder: the tab names the file only
        while (self.page.locator(".jp-NotebookPanel").count() != 1
               or (current.first.text_content() if current.count() else None) != label):
            if time.time() > deadline:
                tabs = self.page.locator(".lm-DockPanel-tabBar .lm-TabBar-tabLabel").all_text_contents()
                pytest.fail(f"{name}.ipynb is not the only open notebook: tabs {tabs}")
            time.sleep(0.25)

    def reset_workspaces(self):
        """Delete every workspace the server saved (layout, open documents) so a new page starts bare."""
        hdr = {"Authorization": f"token {self.token}"}
        req = urllib.request.Request(f"{self.base}/lab/api/workspaces", headers=hdr)
        listing = json.loads(urllib.request.urlopen(req, timeout=30).read())
        for ws in listing.get("workspaces", {}).get("ids", []):
            urllib.request.urlopen(urllib.request.Request(f"{self.base}/lab/api/workspaces/{ws}", method="DELETE",
                                                          headers=hdr), timeout=30)

    def run_all(self):
        """Run > Run All Cells, from the menu bar as a person would, once the kernel has started (clicked
        earlier, JupyterLab walks through the cells without running them); checks that a cell started."""
        self.wait_text("#jp-main-statusbar", r"\| Idle", 180)
        started = self.page.locator(".jp-InputPrompt", has_text=re.compile(r"\[(\*|\d+)\]"))
        for _ in range(3):
            self.page.locator(".lm-MenuBar-item", has_text=re.compile(r"^Run$")).click()
            self.page.locator(".lm-Menu-item", has=self.page.locator(".lm-Menu-itemLabel", has_text=re.compile(
                r"^Run All Cells$"))).click()
            deadline = time.time() + 30 * SLOW
            while time.time() < deadline:
                if started.count():
                    return
                time.sleep(0.5)
        pytest.fail("Run All Cells did not start any cell")

    def wait_text(self, selector: str, pattern: str, timeout_s: float):
        """The first ``selector`` element whose text matches ``pattern``, once it is there. Fails at once when
        a cell shows a traceback, and after ``timeout_s`` (times LOWRANK_LIB_BROWSER_SLOW) with a screenshot."""
        loc = self.page.locator(selector, has_text=re.compile(pattern)).first
        tb = self.page.locator(".jp-OutputArea-output", has_text="Traceback (most recent call last)")
        deadline = time.time() + timeout_s * SLOW
        while True:
            if loc.count():
                loc.scroll_into_view_if_needed()     # where a person would look (and off-screen cells render)
                return loc
            if tb.count():
                pytest.fail(f"a cell failed while waiting for {pattern!r}:\n{self.text(tb.first)[-3000:]}")
            if time.time() > deadline:
                shot = self.nbdir.parent / f"timeout-{int(time.time())}.png"
                self.page.screenshot(path=str(shot), full_page=True)
                outs = self.page.locator(".jp-OutputArea-output").all_text_contents()
                pytest.fail(f"no {selector} matching {pattern!r} after {timeout_s * SLOW:.0f} s; screenshot {shot}; "
                            f"last outputs:\n" + "\n---\n".join(o[-400:] for o in outs[-4:]))
            time.sleep(0.5)

    def slider(self, description: str):
        return self.page.locator(".widget-slider", has=self.page.locator(".widget-label", has_text=re.compile(
            f"^{re.escape(description)}$"))).first

    @staticmethod
    def text(loc) -> str:
        """The element's text (textContent: also right while JupyterLab skips rendering an off-screen cell)."""
        return loc.text_content() or ""

    @staticmethod
    def readout(slider) -> str:
        return (slider.locator(".widget-readout").text_content() or "").strip()

    def key(self, slider, key: str, times: int = 1):
        slider.locator(".noUi-handle").focus()
        for _ in range(times):
            self.page.keyboard.press(key)

    def drag(self, slider, dx: float, steps: int = 12):
        """Press the handle, move it by ``dx`` pixels in ``steps`` moves, release."""
        box = slider.locator(".noUi-handle").bounding_box()
        x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
        self.page.mouse.move(x, y)
        self.page.mouse.down()
        for i in range(1, steps + 1):
            self.page.mouse.move(x + dx * i / steps, y)
        self.page.mouse.up()

    def type_value(self, slider, value: str):
        ro = slider.locator(".widget-readout")
        ro.click()
        self.page.keyboard.press("Control+A")
        self.page.keyboard.type(value)
        self.page.keyboard.press("Enter")

    def shutdown_kernels(self):
        """Stop every kernel of the server (frees the model of a finished notebook before the next one)."""
        hdr = {"Authorization": f"token {self.token}"}
        req = urllib.request.Request(f"{self.base}/api/kernels", headers=hdr)
        for k in json.loads(urllib.request.urlopen(req, timeout=30).read()):
            urllib.request.urlopen(urllib.request.Request(f"{self.base}/api/kernels/{k['id']}", method="DELETE",
                                                          headers=hdr), timeout=60)

    def _written(self) -> dict[Path, int]:
        """Each notebook file's modification time (JupyterLab's checkpoint copies left out)."""
        return {p: p.stat().st_mtime_ns for p in self.nbdir.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts}

    def save(self):
        """Save the notebook (Ctrl+S) and wait until JupyterLab reports it saved: a notebook file on disk rewritten
        since the key press, and the tab without its dirty mark (polled, not a fixed wait: each of those took 1.5 s
        of sleeping per save, an idle core beside the other worker)."""
        before = self._written()
        self.page.locator(".jp-NotebookPanel .jp-Cell").first.click()
        self.page.keyboard.press("Escape")
        self.page.keyboard.press("Control+s")
        dirty = self.page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current.jp-mod-dirty")
        deadline = time.time() + 60 * SLOW
        while dirty.count() or not any(before.get(p) != t for p, t in self._written().items()):
            assert time.time() < deadline, "the notebook did not save"
            time.sleep(0.1)

    def wait_all_done(self, timeout_s: float):
        """Wait until no cell is queued or running ('[*]') and the kernel is idle; fails at once on a traceback.
        Polled once a second: each poll queries every output on the page, and at 0.25 s the test process and Chromium
        took 10.9 and 17.0 CPU-seconds of notebook 00's 84 s Run All (8.0 and 15.6 at 1 s; `top`, 1 thread, one run
        each), taken from the other worker of a 2-core machine."""
        busy = self.page.locator(".jp-InputPrompt", has_text=re.compile(r"\[\*\]"))
        tb = self.page.locator(".jp-OutputArea-output", has_text="Traceback (most recent call last)")
        deadline = time.time() + timeout_s * SLOW
        idle_since = None
        while True:
            if tb.count():
                pytest.fail(f"a cell failed:\n{self.text(tb.first)[-3000:]}")
            if not busy.count() and self.page.locator("#jp-main-statusbar", has_text=re.compile(r"\| Idle")).count():
                idle_since = idle_since or time.time()
                if time.time() - idle_since > 1.0:      # idle for a second: not between two cells
                    return
            else:
                idle_since = None
            if time.time() > deadline:
                shot = self.nbdir.parent / f"timeout-{int(time.time())}.png"
                self.page.screenshot(path=str(shot), full_page=True)
                pytest.fail(f"Run All did not finish in {timeout_s * SLOW:.0f} s; screenshot {shot}")
            time.sleep(1.0)

    def panels(self):
        """The slider panels on the page: each a VBox of sliders and its status line (an HTML widget)."""
        return self.page.locator(".widget-vbox", has=self.page.locator(".widget-slider"))

    def status(self, panel) -> str:
        return (panel.locator(".widget-html").last.text_content() or "").strip()

    def wait_status(self, panel, pattern: str, timeout_s: float) -> str:
        """The panel's status line once it matches ``pattern`` (a traceback in the view fails at once)."""
        deadline = time.time() + timeout_s * SLOW
        while True:
            text = self.status(panel)
            if re.search(pattern, text):
                return text
            if "failed" in text:
                outs = self.page.locator(".jp-OutputArea-output").all_text_contents()
                pytest.fail(f"the slider panel failed: {text}\n" + "\n---\n".join(o[-1500:] for o in outs[-3:]))
            if time.time() > deadline:
                pytest.fail(f"the slider panel's status is {text!r}, not {pattern!r}, after {timeout_s * SLOW:.0f} s")
            time.sleep(0.2)

    def assert_clean(self):
        errors = self.page.locator("text=Error displaying widget").count()
        assert errors == 0, f"{errors} widget(s) show 'Error displaying widget'"
        assert not self.console, "browser console errors:\n" + "\n".join(self.console)


@pytest.fixture(scope="session")
def timings():
    return Timings


@pytest.fixture(scope="session")
def playwright_sync():
    """ONE Playwright (sync API) for the session: a second ``sync_playwright()`` while one is running fails
    ("using Playwright Sync API inside the asyncio loop"), so every browser fixture launches from this one."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        yield p


@pytest.fixture(scope="session")
def browser_context(lab_server, tmp_path_factory, playwright_sync):
    profile = tmp_path_factory.mktemp("chromium-profile")     # a fresh user-data-dir
    ctx = playwright_sync.chromium.launch_persistent_context(str(profile), executable_path=CHROMIUM, headless=True,
                                                             args=CHROMIUM_ARGS, viewport={"width": 1500, "height": 1000})
    try:
        yield ctx
    finally:
        ctx.close()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def lab(lab_server, browser_context):
    base, token, nbdir = lab_server
    page = browser_context.new_page()
    lab = Lab(page, base, token, nbdir)
    lab.reset_workspaces()
    try:
        yield lab
    finally:
        lab.page.close()
        lab.shutdown_kernels()
