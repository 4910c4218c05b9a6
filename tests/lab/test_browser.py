"""Every notebook, run as a learner runs it: in JupyterLab, in a real (headless) Chromium.

nbval checks that the cells run; this checks what a reader sees. For each notebook: Run All, then

* no cell shows an error (no ``stderr`` output, no traceback);
* every widget view rendered (no "Error displaying widget", no "model not found", no raw ``VBox(``
  text where a panel should be);
* every plotly figure drawn, and every label of it inside the figure (a label that plotly puts at
  10**value on a log axis lands outside and is cut or hidden) -- tables show all their rows;
* no error in the browser console;
* one control of every panel driven through the page (a slider, a checkbox, a button), and the
  panel's figure or text changes.

Screenshots go to ``wsharding-out/screenshots/`` (git-ignored). Playwright drives Debian's
``/usr/bin/chromium`` (it cannot download its own browser here): ``.ci/run`` installs it with
``fonts-noto-cjk``, since the notebooks quote the seeds in Chinese. Outside CI, without them, the
module is skipped; in CI their absence is a failure.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from wsharding.runtime import in_ci

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
SHOTS = ROOT / "wsharding-out" / "screenshots"
CHROMIUM = os.environ.get("WSHARDING_CHROMIUM", "/usr/bin/chromium")
#: Seconds a notebook may take to run all its cells in the browser (they take 7-40 s on 2 cores).
RUN_TIMEOUT = 300


def _missing() -> str:
    if not Path(CHROMIUM).exists():
        return f"no Chromium at {CHROMIUM} (apt-get install chromium fonts-noto-cjk)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install playwright, or scripts/setup.sh --test)"
    if shutil.which("jupyter-lab", path=os.path.dirname(sys.executable)) is None:
        return "jupyterlab is not installed in this environment"
    return ""


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on 127.0.0.1 with a random token, run from the repository root; kernels
    see this checkout first on their path. Autosave is off: the notebooks on disk never change."""
    why = _missing()
    if why:
        if in_ci():
            pytest.fail(f"the browser test cannot run in CI: {why}")
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp("lab")
    settings = tmp / "settings"
    for plugin, values in {
        "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
        "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
        # every cell in the DOM and laid out, so that sizes and positions can be read
        # (and no empty space after the last cell: whole-notebook screenshots end with it)
        "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none", "scrollPastEnd": False},
    }.items():
        f = settings / f"{plugin}.jupyterlab-settings"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps(values))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = secrets.token_hex(16)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               JUPYTER_RUNTIME_DIR=str(tmp / "runtime"), CI=os.environ.get("CI", "true"))
    # ipykernel captures the kernel's file descriptors 1 and 2 -- where rank processes, which inherit them,
    # write (a library's log lines, a warning) -- unless PYTEST_CURRENT_TEST is set (it then leaves fd capture to
    # pytest). pytest sets it while this fixture runs; the server would pass it to every kernel, and a rank's
    # stderr that a reader sees in red would go to the server's log instead of the page.
    env.pop("PYTEST_CURRENT_TEST", None)
    log = open(tmp / "lab.log", "w")  # noqa: SIM115 -- closed at teardown
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ip", "127.0.0.1", "--port", str(port),
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={ROOT}", "--LabApp.expose_app_in_browser=True",
         f"--LabApp.user_settings_dir={settings}", f"--LabApp.workspaces_dir={tmp / 'workspaces'}",
         # opening a notebook writes a checkpoint of it: not into the checkout
         f"--FileCheckpoints.root_dir={tmp / 'checkpoints'}"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    server = {"base": base, "token": token, "proc": proc, "log": tmp / "lab.log"}
    deadline = time.monotonic() + 90
    while True:
        try:
            api(server, "/api/status")
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail("JupyterLab did not start:\n" + (tmp / "lab.log").read_text()[-3000:])
            time.sleep(0.5)
    yield server
    for k in api(server, "/api/kernels"):
        api(server, f"/api/kernels/{k['id']}", method="DELETE")
    os.killpg(proc.pid, signal.SIGTERM)  # the server and the kernels it started (its own session)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    log.close()


def api(server: dict, path: str, method: str = "GET"):
    req = urllib.request.Request(server["base"] + path, method=method,
                                 headers={"Authorization": f"token {server['token']}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        body = r.read()
    return json.loads(body) if body else None


@pytest.fixture(scope="module")
def browser(lab):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


# ---- what the page shows -------------------------------------------------------------------------------
#: Counts of what a reader would call broken, read from the DOM in one pass.
PAGE_FACTS = """() => {
  const nb = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook');
  const cells = [...nb.querySelectorAll('.jp-CodeCell')];
  // a cell whose input is folded (the check cell: metadata jupyter.source_hidden) shows no prompt:
  // its execution count is read from its model
  const shell = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const models = shell && shell.content ? shell.content.widgets.filter(w => w.model.type === 'code') : [];
  const prompts = cells.map((c, i) => {
    const shown = (c.querySelector('.jp-InputArea-prompt') || {}).textContent || '';
    if (shown.trim() || !c.querySelector('.jp-InputPlaceholder') || !models[i]) return shown;
    const n = models[i].model.executionCount;
    return n ? `[${n}]:` : shown;
  });
  const stderr = [...nb.querySelectorAll('[data-mime-type="application/vnd.jupyter.stderr"]')]
      .map(e => e.innerText.slice(0, 600));
  const text = nb.innerText;
  const bad_widget = ['Error displaying widget', 'model not found', 'VBox(', 'HBox(', 'Output()',
                      'Loading widget...'].filter(s => text.includes(s));
  const plots = [...nb.querySelectorAll('.js-plotly-plot')];
  const undrawn = plots.filter(p => !p.querySelector('.main-svg') || p.getBoundingClientRect().width < 50).length;
  // a slider a reader cannot drag: its track narrower than 100 px
  const narrow_sliders = [...nb.querySelectorAll('.widget-slider .slider-container, .widget-hslider .slider-container')]
      .filter(e => e.getBoundingClientRect().width < 100).length;
  // an exception shown inside a widget panel (no stderr, but red text all the same)
  const panel_errors = [...nb.querySelectorAll('.jupyter-widgets')].map(e => e.innerText)
      .filter(t => /\b[A-Z][A-Za-z]*Error\b:/.test(t)).map(t => t.slice(0, 200));
  return {prompts, stderr, bad_widget, plots: plots.length, undrawn, narrow_sliders, panel_errors};
}"""

#: Labels of every figure that fall outside it (plotly cuts or hides them), and tables that show
#: fewer rows than they hold. One entry per problem, naming the figure by its title.
LABEL_PROBLEMS = """() => {
  const out = [];
  const nb = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook');
  for (const plot of nb.querySelectorAll('.js-plotly-plot')) {
    const svg = plot.querySelector('.main-svg');
    if (!svg) continue;
    const box = svg.getBoundingClientRect();
    const full = plot._fullLayout || {};
    const title = ((full.title || {}).text || '(untitled)').slice(0, 80);
    const inside = (r) => r.left >= box.left - 1 && r.right <= box.right + 1 && r.top >= box.top - 1 && r.bottom <= box.bottom + 1;
    // annotations (hline/vline labels included): each one in the layout must be drawn, inside
    (full.annotations || []).forEach((a, i) => {
      if (a.visible === false || !a.text) return;
      const g = plot.querySelector(`.annotation[data-index="${i}"] .annotation-text`);
      const r = g && g.getBoundingClientRect();
      if (!r || !r.width) out.push(`${title}: annotation "${a.text}" is not drawn (outside its axis range?)`);
      else if (!inside(r)) out.push(`${title}: annotation "${a.text}" is cut (outside the figure)`);
    });
    // a legend taller than its room: plotly scrolls it (a scroll bar appears) and cuts its rows
    const bar = plot.querySelector('.legend .scrollbar');
    if (bar && bar.getBoundingClientRect().height > 0) out.push(`${title}: its legend scrolls (rows cut)`);
    // the title and an annotation (a subplot's title) drawn over each other: a title of several lines
    // centred in a margin too small for it grows down over the first subplot's title
    const gt = plot.querySelector('.gtitle');
    const tr = gt && gt.getBoundingClientRect();
    if (tr && tr.width) for (const a of plot.querySelectorAll('.annotation-text')) {
      const r = a.getBoundingClientRect();
      if (r.width && r.left < tr.right && tr.left < r.right && r.top < tr.bottom - 1 && tr.top < r.bottom - 1)
        out.push(`${title}: the title is drawn over "${a.textContent.slice(0, 60)}"`);
    }
    for (const t of plot.querySelectorAll('.gtitle, .bartext, .textpoint text, .g-xtitle text, .g-ytitle text')) {
      const r = t.getBoundingClientRect();
      if (r.width && !inside(r)) out.push(`${title}: text "${t.textContent.slice(0, 60)}" is cut at the figure's edge`);
    }
    // bar and marker labels clipped by the plot area: compare with the subplot's drag rectangle
    // (a figure of several subplots has one drag rectangle each: a label must sit inside one of them)
    const areas = [...plot.querySelectorAll('.nsewdrag')].map(a => a.getBoundingClientRect());
    if (areas.length) {
      for (const t of plot.querySelectorAll('.bartext, .textpoint text')) {
        const clipped = t.closest('[clip-path]');
        const r = t.getBoundingClientRect();
        if (clipped && r.width && !areas.some(a => r.top >= a.top - 1 && r.bottom <= a.bottom + 1))
          out.push(`${title}: label "${t.textContent.slice(0, 60)}" is cut by the plot area`);
      }
    }
    // tables: every row visible without scrolling -- the last row's cells end inside the visible
    // track (the scroll bar's kit spans the rows a reader sees; its glyph only shows on hover)
    for (const kit of plot.querySelectorAll('.scrollbar-kit')) {
      const table = kit.closest('.table') || plot;
      const bottoms = [...table.querySelectorAll('.column-cell')].map(c => c.getBoundingClientRect().bottom);
      const rows = ((plot.data || []).find(d => d.type === 'table') || {cells: {values: [[]]}}).cells.values[0].length;
      if (bottoms.length && Math.max(...bottoms) > kit.getBoundingClientRect().bottom + 1)
        out.push(`${title}: table of ${rows} rows needs scrolling (too little height)`);
    }
  }
  return out;
}"""

#: The notebook's kernel connection and status, from JupyterLab's own objects.
KERNEL_STATE = """() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
  return k ? [k.connectionStatus, k.status] : null; }"""

#: A fingerprint of one widget panel: its text and the geometry of its figures.
PANEL_STATE = """(el) => el.innerText + '|' + [...el.querySelectorAll('.main-svg path, .main-svg text')]
    .map(e => (e.getAttribute('d') || e.textContent || '')).join(';')"""


def wait_idle(page, server: dict, timeout: float = RUN_TIMEOUT) -> None:
    """Until the kernel is idle and no cell shows [*], twice in a row half a second apart."""
    deadline = time.monotonic() + timeout
    quiet = 0
    while quiet < 2:
        if time.monotonic() > deadline:
            raise AssertionError(f"the notebook did not finish within {timeout} s")
        busy = any(k["execution_state"] != "idle" for k in api(server, "/api/kernels"))
        running = page.evaluate(PAGE_FACTS)["prompts"]
        quiet = quiet + 1 if not busy and not any("*" in p for p in running) else 0
        time.sleep(0.5)


def panels(page):
    """The top-level widget views in the notebook's outputs (one per panel), the questions' panels
    (``quiz_panel``) apart."""
    return [p for p in page.locator(".jp-OutputArea-output > .jupyter-widgets.widget-container, "
                                    ".jp-OutputArea-output > .jupyter-widgets.lm-Widget.widget-box").all()
            if "wsharding-quiz" not in (p.get_attribute("class") or "")]


def check_quiz_panels(page, server) -> int:
    """Every question panel: "Check" with no prediction asks for one, "Show answer" shows it (and
    nothing raises). Returns how many questions were tried."""
    n = 0
    for quiz in page.locator(".jupyter-widgets.wsharding-quiz").all():
        for check, show in zip(quiz.locator("button.jupyter-button", has_text="Check").all(),
                               quiz.locator("button.jupyter-button", has_text="Show answer").all(), strict=True):
            # a label cut to "Sho..." shows as text wider than its button
            for b in (check, show):
                assert b.evaluate("(el) => el.scrollWidth <= el.clientWidth + 1"), f"button cut: {b.inner_text()!r}"
            # the verdict shows beside the buttons, in the row: wait for it there (each callback's own
            # output), not for a quiet kernel twice per click; the kernel is waited for once at the end
            row = check.locator("xpath=..")
            check.click()
            row.get_by_text("write your prediction first").first.wait_for(timeout=60_000)
            text = quiz.inner_text()
            assert "write your prediction first" in text, text[:300]
            assert "run the cell" not in text and ".reveal()" not in text, text[:300]
            show.click()
            row.get_by_text("answer:").first.wait_for(timeout=60_000)
            assert "answer:" in quiz.inner_text(), quiz.inner_text()[:300]
            n += 1
    wait_idle(page, server, 60)
    return n


def _control(panel, kind: str, label: str):
    if kind == "button":
        return panel.locator("button.jupyter-button", has_text=label).first
    # a control is a .widget-inline-hbox with its description inside (a checkbox keeps it in a span)
    return panel.locator(".widget-inline-hbox", has_text=label).first


def drive(page, server, panel, kind: str, label: str, value=None) -> None:
    """Use one control of ``panel`` as a person would, then wait for the kernel."""
    c = _control(panel, kind, label)
    c.scroll_into_view_if_needed()
    if kind == "button":
        c.click()
    elif kind == "checkbox":
        c.locator("input[type=checkbox]").click()
    elif kind == "slider":
        handle = c.locator(".noUi-handle, .slider-handle").first
        handle.focus()
        handle.press("ArrowRight")
    elif kind == "dropdown":
        c.locator("select").select_option(str(value))
    elif kind == "int":
        box = c.locator("input")
        box.fill(str(value))
        box.press("Enter")
    else:
        raise ValueError(kind)
    time.sleep(0.5)
    wait_idle(page, server)


#: notebook prefix -> per panel: the controls driven in order (kind, label[, value]) and a text the
#: panel must show afterwards. Notebooks not listed (new ones) get the first slider, checkbox or
#: button of each panel that changes it.
DRIVES: dict[str, list[tuple[list[tuple], str]]] = {
    "00": [([("slider", "N ranks")], "N = 9")],  # the preset's 8 ranks, one step right
    "01": [([("dropdown", "weights", "Kimi-K3-like MoE peripherals, block FP8, 1/32 scale (gatherable on CPU ranks)"),
             ("button", "gather on ranks")], "byte-exact on every rank")],
    "02": [([("button", "run AllGather benchmark")], "emulated")],
    "03": [([("checkbox", "lookahead"), ("button", "run on ranks")], "lookahead off")],
    "04": [([("button", "load on ranks")], "peak held")],
    "05": [([("int", "KV heads", 4)], "K=4")],
    "06": [],  # one figure per idea, no panel
    "07": [([("button", "serve")], "budgets so far")],  # the figure of the sweep, one budget more
    "08": [([("button", "run benchmark")], "mode:")],
}


#: Printed (stream) lines that the output area wraps: JupyterLab breaks a printed <pre> anywhere
#: (``word-break: break-all``), so a line wider than the output area is cut inside a word or a
#: number ("conser vative", "sh arded"). A line wraps where its text takes more line boxes than it has
#: lines. One entry per wrapped line: its start.
STREAM_WRAPS = """() => {
  const out = [];
  const nb = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook');
  for (const pre of nb.querySelectorAll('[data-mime-type="application/vnd.jupyter.stdout"] pre')) {
    const lines = pre.textContent.replace(/\\n$/, '').split('\\n');
    const range = document.createRange();
    range.selectNodeContents(pre);
    const tops = new Set([...range.getClientRects()].filter(r => r.width > 0).map(r => Math.round(r.top)));
    if (tops.size > lines.length) {
      const w = pre.getBoundingClientRect().width;
      const longest = lines.reduce((a, b) => (b.length > a.length ? b : a), '');
      out.push(`${longest.length} chars in ${Math.round(w)} px: "${longest.slice(0, 90)}"`);
    }
  }
  return out;
}"""


def stream_wraps_at_1280(page) -> list[str]:
    """Printed lines that wrap at 1280 px with the file browser open (as a learner opens the series),
    then the viewport and the side bar as they were."""
    page.set_viewport_size({"width": 1280, "height": 900})
    page.evaluate("() => window.jupyterapp.commands.execute('filebrowser:activate')")
    page.evaluate("() => window.dispatchEvent(new Event('resize'))")
    time.sleep(1.0)
    opened = page.evaluate("() => !document.querySelector('#jp-left-stack').classList.contains('lm-mod-hidden')")
    wraps = page.evaluate(STREAM_WRAPS)
    page.evaluate("() => window.jupyterapp.commands.execute('application:toggle-left-area')")
    page.set_viewport_size({"width": 1400, "height": 1000})
    time.sleep(0.5)
    assert opened, "the file browser did not open"
    return wraps


#: <pre> blocks with text in a panel that the browser may break inside a word.
PANEL_PRE_BREAK_ALL = """(el) => [...el.querySelectorAll('pre')].filter(
    (p) => p.textContent.trim() && getComputedStyle(p).wordBreak === 'break-all').length"""


def drive_any(page, server, panel) -> str:
    """For a panel no plan names: try its controls (sliders, checkboxes, then buttons) until one
    changes it; returns what was driven."""
    before = _fingerprint(panel)
    for kind, sel in (("slider", ".widget-slider"), ("checkbox", ".widget-checkbox"), ("button", "button.jupyter-button")):
        for el in panel.locator(sel).all():
            label = el.inner_text().strip().splitlines()[0] if kind == "button" else el.inner_text().strip().split("\n")[0]
            drive(page, server, panel, kind, label)
            if _fingerprint(panel) != before:
                return f"{kind} {label!r}"
    raise AssertionError("no slider, checkbox or button of this panel changed it")


def _fingerprint(panel) -> str:
    return hashlib.sha1(panel.evaluate(PANEL_STATE).encode()).hexdigest()


def log(msg: str) -> None:
    print(f"[browser {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_notebook(browser, lab, nb: Path) -> dict:
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    console = []
    page.on("console", lambda m: console.append(f"{m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
    before = nb.read_bytes()
    t_open = time.monotonic()
    page.goto(f"{lab['base']}/lab/tree/notebooks/{nb.name}?reset&token={lab['token']}")
    page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-Cell", timeout=60_000)
    page.wait_for_function("() => window.jupyterapp && document.querySelector('.jp-NotebookPanel-toolbar')",
                           timeout=60_000)
    # The kernel must be connected and idle before Run All: cells sent earlier are lost, and Run
    # All stops after the first one.
    page.wait_for_function(f"() => {{ const s = ({KERNEL_STATE})(); return s && s[0] === 'connected' && s[1] === 'idle'; }}",
                           timeout=90_000)
    t0 = time.monotonic()
    log(f"{nb.name}: opened, kernel idle, in {t0 - t_open:.1f} s")
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
    time.sleep(1.0)
    wait_idle(page, lab)
    log(f"{nb.name}: ran in {time.monotonic() - t0:.1f} s")
    return {"page": page, "console": console, "before": before, "seconds": time.monotonic() - t0}


def panel_screenshot(page, panel, name: str) -> Path:
    """One panel, whole: the viewport grows to hold it (JupyterLab scrolls inside its own panel)."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    height = panel.evaluate("(el) => Math.ceil(el.getBoundingClientRect().height)")
    page.set_viewport_size({"width": 1400, "height": max(1000, height + 400)})
    time.sleep(0.5)
    path = SHOTS / f"{name}.png"
    panel.screenshot(path=str(path))
    page.set_viewport_size({"width": 1400, "height": 1000})
    return path


#: The notebook panel's layout, read after the browser drew a frame: it changes while Lumino and
#: plotly lay out again (after a resize, a scroll).
LAYOUT = """(sel) => new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(() => {
  const s = document.querySelector(sel);
  done(s ? [s.scrollHeight, s.clientHeight, s.scrollTop] : null);
})))"""


def settle(page, scroller: str, timeout: float = 5.0) -> None:
    """Until the panel's layout is the same over a quarter of a second (or ``timeout`` s passed)."""
    deadline = time.monotonic() + timeout
    last = page.evaluate(LAYOUT, scroller)
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = page.evaluate(LAYOUT, scroller)
        if now == last:
            return
        last = now


def screenshot(page, name: str) -> Path:
    """The whole notebook: JupyterLab scrolls inside its panel, so grow the viewport until the panel
    holds every cell, and scroll it back to the top."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    scroller = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-WindowedPanel-outer"
    for _ in range(3):  # the panel's height follows the viewport: converge on the content's height
        extra = page.evaluate(f"""() => {{ const s = document.querySelector('{scroller}');
            return s ? s.scrollHeight - s.clientHeight : 0; }}""")
        if extra <= 0:
            break
        size = page.viewport_size
        page.set_viewport_size({"width": size["width"], "height": min(size["height"] + extra + 50, 30000)})
        page.evaluate("() => window.dispatchEvent(new Event('resize'))")  # Lumino lays out on resize
        settle(page, scroller)
    page.evaluate(f"() => {{ const s = document.querySelector('{scroller}'); if (s) s.scrollTop = 0; }}")
    settle(page, scroller)
    path = SHOTS / f"{name}.png"
    page.screenshot(path=str(path))
    return path


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_in_the_browser(nb, browser, lab):
    run = run_notebook(browser, lab, nb)
    page = run["page"]
    facts = page.evaluate(PAGE_FACTS)
    code_cells = [c for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code"]
    try:
        assert facts["stderr"] == [], f"{nb.name}: error output:\n" + "\n---\n".join(facts["stderr"])
        assert all(p.strip() not in ("[ ]:", "[*]:", "") for p in facts["prompts"]), (
            f"{nb.name}: not every cell ran: {facts['prompts']}")
        assert len(facts["prompts"]) == len(code_cells)
        assert facts["bad_widget"] == [], f"{nb.name}: a widget did not render: {facts['bad_widget']}"
        assert facts["undrawn"] == 0, f"{nb.name}: {facts['undrawn']} of {facts['plots']} plotly figures not drawn"
        assert facts["narrow_sliders"] == 0, f"{nb.name}: {facts['narrow_sliders']} slider(s) too narrow to drag"
        assert facts["panel_errors"] == [], f"{nb.name}: a panel shows an error after Run All: {facts['panel_errors']}"
        problems = page.evaluate(LABEL_PROBLEMS)
        assert problems == [], f"{nb.name}: labels a reader cannot see:\n" + "\n".join(problems)
        wraps = stream_wraps_at_1280(page)
        assert wraps == [], f"{nb.name}: printed lines wrap at 1280 px with the file browser open:\n" + "\n".join(wraps)

        # one control per panel, through the page
        found = panels(page)
        plan = DRIVES.get(nb.name[:2])
        if plan is not None:
            assert len(found) == len(plan), f"{nb.name}: expected {len(plan)} panels, found {len(found)}"
        for i, panel in enumerate(found):
            before = _fingerprint(panel)
            if plan is not None:
                steps, expect = plan[i]
                for step in steps:
                    drive(page, lab, panel, *step)
                what = steps
                shown = panel.evaluate("(el) => el.textContent").replace("\xa0", " ")  # SVG text included
                assert expect in shown, f"{nb.name}: panel {i} does not show {expect!r} after {steps}"
            else:
                what = drive_any(page, lab, panel)
            assert _fingerprint(panel) != before, f"{nb.name}: panel {i} did not change after {what}"
            # JupyterLab breaks a printed <pre> anywhere (numbers and names cut in two at 1280 px): a
            # panel shows its text with pre_html, which wraps at spaces only
            assert panel.evaluate(PANEL_PRE_BREAK_ALL) == 0, f"{nb.name}: panel {i} prints text that wraps mid-word"
            log(f"{nb.name}: panel {i} changed after {what}")
            panel_screenshot(page, panel, f"{nb.stem}_panel{i}")
        log(f"{nb.name}: {check_quiz_panels(page, lab)} question(s) checked and revealed in their panels")
        facts = page.evaluate(PAGE_FACTS)
        assert facts["stderr"] == [], f"{nb.name}: error output after driving the panels:\n" + "\n".join(facts["stderr"])
        assert run["console"] == [], f"{nb.name}: browser console errors:\n" + "\n".join(run["console"])
    finally:
        t_shot = time.monotonic()
        screenshot(page, nb.stem)
        log(f"{nb.name}: screenshot in {time.monotonic() - t_shot:.1f} s")
        page.close()
        for k in api(lab, "/api/kernels"):
            api(lab, f"/api/kernels/{k['id']}", method="DELETE")
    assert nb.read_bytes() == run["before"], f"{nb.name} was changed on disk by the browser run"
