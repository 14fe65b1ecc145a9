"""The monitor in a real JupyterLab, driven by headless Chromium through Playwright.

Starts JupyterLab on 127.0.0.1 (random free port, random token, a temporary copy of the fixture
notebook, isolated Jupyter config/data/runtime dirs), runs all cells from the Run menu, and while the
training cell is still running ([*] prompt) reads the DeviceMonitor panel's text twice, a few seconds
apart: widget updates sent from the monitor's thread must reach the page while the kernel is busy
(they did not with ipykernel 7.0). The fixture speaks Chinese (the monitor's labels come from its zh_CN
catalog; the English ones are tested in tests/test_monitor.py). A second test opens a Chinese course notebook. Saves screenshots under artifacts/ and shuts the server down.

Needs /usr/bin/chromium (`.ci/browser-setup.sh` installs it); skipped with a reason otherwise.
"""
from __future__ import annotations

import json
import os
import re
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

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).with_name("monitor_fixture.ipynb")
ARTIFACTS = ROOT / "artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TRAINING_CELL = 3  # index among all cells (markdown first) of the cell that trains for >= 24 s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab(tmp_path):
    """A JupyterLab server with the fixture notebook; yields (base_url, token); always shut down."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"{CHROMIUM} is missing: run .ci/browser-setup.sh (apt-get install chromium) to run this test")
    pytest.importorskip("playwright.sync_api", reason="the playwright Python package is not installed")
    root = tmp_path / "notebooks"
    root.mkdir()
    shutil.copy(FIXTURE, root / FIXTURE.name)
    config = tmp_path / "jupyter-config"
    (config / "labconfig").mkdir(parents=True)
    # no "would you like news?" toast, no update check: nothing may reach for the network
    (config / "labconfig" / "page_config.json").write_text(json.dumps(
        {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}))
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(config), JUPYTER_DATA_DIR=str(tmp_path / "jupyter-data"),
               JUPYTER_RUNTIME_DIR=str(tmp_path / "jupyter-runtime"), IPYTHONDIR=str(tmp_path / "ipython"),
               JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "lab-settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "lab-workspaces"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    port, token = _free_port(), secrets.token_hex(16)
    log = open(tmp_path / "jupyterlab.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
         "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         "--LabApp.extension_manager=readonly", "--ServerApp.shutdown_no_activity_timeout=600"]
        + (["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []),  # CI containers run as root
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            if server.poll() is not None:
                pytest.fail(f"JupyterLab exited with {server.returncode}:\n{(tmp_path / 'jupyterlab.log').read_text()}")
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"JupyterLab did not answer within 90 s:\n{(tmp_path / 'jupyterlab.log').read_text()}")
            time.sleep(0.5)
        yield base, token
    finally:
        server.send_signal(signal.SIGTERM)  # the server shuts its kernels down on SIGTERM
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)  # its own session: the server and its kernels
            server.wait(10)
        log.close()


def _prompt(page, index: int) -> str:
    return page.locator(".jp-Notebook .jp-Cell").nth(index).locator(".jp-InputPrompt").inner_text().strip()


def _sample_number(text: str) -> int:
    match = re.search(r"第 (\d+) 次采样", text)  # "sample N" in the fixture's language, Chinese
    assert match, f"no '第 N 次采样' (sample N) in the panel text:\n{text}"
    return int(match.group(1))


def _row(text: str, name: str) -> str:
    lines = text.splitlines()
    for i, line in enumerate(lines):  # a row's name, bar and value may come out on one line or several
        if line.strip() == name or line.strip().startswith(name + "\t"):
            rest = line.strip()[len(name):].strip()
            return rest or (lines[i + 1].strip() if i + 1 < len(lines) else "")
    raise AssertionError(f"no {name!r} row in the panel text:\n{text}")


def _dismiss_dialogs(page, seen: list) -> None:
    """Accept any JupyterLab dialog in the way (e.g. a kernel choice offered while the machine is slow),
    keeping its text so a failure can say what it was."""
    dialogs = page.locator(".jp-Dialog")
    for _ in range(3):
        if dialogs.count() == 0:
            return
        seen.append(dialogs.first.inner_text()[:300])
        buttons = dialogs.first.locator(".jp-Dialog-button.jp-mod-accept")
        if buttons.count():
            buttons.first.click()
        else:
            page.keyboard.press("Escape")
        time.sleep(0.5)


def test_monitor_updates_in_a_real_jupyterlab_while_a_cell_runs(lab):
    from playwright.sync_api import TimeoutError as PlaywrightTimeoutError
    from playwright.sync_api import expect, sync_playwright

    base, token = lab
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.set_default_timeout(60_000)
            page.goto(f"{base}/lab/tree/{FIXTURE.name}?token={token}")
            cells = page.locator(".jp-Notebook .jp-Cell")
            expect(cells).to_have_count(5, timeout=90_000)
            # the kernel must be up before "Run All" or the run waits on a kernel-selection dialog
            expect(page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']")).to_have_count(1,
                                                                                                      timeout=90_000)
            dialogs_seen = []
            for attempt in range(3):  # a click can land while the page is still settling: check it took
                _dismiss_dialogs(page, dialogs_seen)
                try:
                    cells.nth(1).click(timeout=15_000)
                    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click(timeout=15_000)
                    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click(timeout=15_000)
                except PlaywrightTimeoutError:  # something (a dialog) was in the way: dismiss it, try again
                    continue
                deadline = time.monotonic() + 15
                while _prompt(page, 1) == "[ ]:" and time.monotonic() < deadline:
                    time.sleep(0.25)
                if _prompt(page, 1) != "[ ]:":
                    break
            else:
                pytest.fail(f"Run > Run All Cells did not start the notebook (dialogs seen: {dialogs_seen})")

            panel = page.locator(".course-device-monitor")
            progress = page.locator(".course-training-progress")
            expect(panel).to_be_visible(timeout=60_000)
            expect(progress).to_be_visible(timeout=60_000)  # the training cell has started
            # sample 2 or later: the monitor may be several samples in by the time the training cell shows
            second = re.compile(r"第 ([2-9]|\d{2,}) 次采样")
            expect(page.locator(".course-device-monitor", has_text=second)).to_have_count(1, timeout=30_000)

            # read the panels while the training cell is busy: at least twice, a few seconds apart
            reads = []  # (time, monitor text, progress text), each taken while the prompt showed [*]
            while len(reads) < 3 and _prompt(page, TRAINING_CELL) == "[*]:":
                at, texts = time.monotonic(), (panel.inner_text(), progress.inner_text())
                if _prompt(page, TRAINING_CELL) != "[*]:":
                    break  # the cell ended during the read: it does not count
                reads.append((at, *texts))
                if len(reads) == 2:
                    panel.screenshot(path=str(ARTIFACTS / "monitor_panel.png"))
                    progress.screenshot(path=str(ARTIFACTS / "training_progress.png"))
                time.sleep(2.5)
            assert len(reads) >= 2, f"the training cell ended before two reads while busy: {reads}"

            (t0, first, _), (t1, last, _) = reads[0], reads[-1]
            # the thread refreshes about once a second while the kernel is busy
            assert _sample_number(last) >= _sample_number(first) + max(1, int(0.5 * (t1 - t0))), (first, last)
            # the labels are the Chinese catalog's ("host CPU and RAM", "N % of M CPUs", "this kernel's RAM")
            assert "主机 CPU 与内存" in first and " 的 " in first and " %" in first, first
            # a measured value, not only the status line: the fixture's cache makes the kernel's RAM grow
            assert _row(first, "本内核占用的内存") != _row(last, "本内核占用的内存"), (first, last)
            steps = [int(re.search(r"(\d+)/200 步", p_text).group(1)) for _, _, p_text in reads]
            assert steps == sorted(set(steps)), reads  # the progress bar moves too

            # the run finishes cleanly: the monitor stops and nothing was written to stderr by a thread
            expect(page.locator(".jp-OutputArea-output", has_text="training finished after 200 steps")
                   ).to_have_count(1, timeout=90_000)
            expect(panel).to_contain_text("停止于")  # "stopped at"
            assert page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']").count() == 0
            page.screenshot(path=str(ARTIFACTS / "monitor_notebook.png"), full_page=True)
        finally:
            browser.close()


SLIDES_NOTEBOOK = ROOT / "notebooks" / "01_callables.ipynb"


def _screens_in_order(types: list) -> list:
    """The reveal.js locations (section id, fragment index or None) that Space steps through, in order, for the
    given slide types: what RISE builds from the metadata."""
    steps, x, y = [], -1, 0
    for kind in types:
        if kind in ("skip", "notes"):
            continue
        if x < 0 or kind == "slide":
            x, y = x + 1, 0
            steps.append((f"slide-{x}-{y}", None))
        elif kind == "subslide":
            y += 1
            steps.append((f"slide-{x}-{y}", None))
        elif kind == "fragment":
            section, fragment = steps[-1]
            steps.append((section, 0 if fragment is None else fragment + 1))
    return steps


def test_notebook_shows_as_rise_slides(lab, tmp_path):
    """A course notebook, given its slide metadata by `python -m course_tools.slides`, as a RISE slideshow: the
    /rise/<path> page that RISE's toolbar button (Alt+R) shows in JupyterLab, here at 1280x720. Space steps through
    exactly the slides, subslides and fragments the metadata makes, and no screen of several cells is taller than
    the window. Then Alt+R in JupyterLab opens the same slideshow beside the notebook."""
    pytest.importorskip("jupyterlab_rise", reason="jupyterlab-rise (requirements.txt) is not installed")
    from playwright.sync_api import expect, sync_playwright

    from course_tools import slides

    base, token = lab
    notebook = tmp_path / "notebooks" / SLIDES_NOTEBOOK.name
    shutil.copy(SLIDES_NOTEBOOK, notebook)
    slides.rewrite(notebook)  # the committed notebook may not have its metadata yet: the command gives it
    cells = json.loads(notebook.read_text())["cells"]
    types = [slides.current_type(c) for c in cells]
    expected = _screens_in_order(types)
    screens = slides.slides(cells)
    assert len({s for s, _ in expected}) == len(screens) > 10
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            width, height = slides.SCREEN
            page = browser.new_page(viewport={"width": width, "height": height})
            page.set_default_timeout(60_000)
            page.goto(f"{base}/rise/{notebook.name}?token={token}")
            present = page.locator(".reveal .slides section.present[id^='slide-']")
            expect(present.first).to_be_visible(timeout=90_000)  # reveal.js has laid the slides out
            expect(present.last).to_have_id("slide-0-0")
            expect(present.last.locator("h1")).to_contain_text("Callable objects")
            # reveal's structure is the metadata's: one top-level section per "slide", one inner per screen
            assert page.locator(".reveal .slides > section").count() == types.count("slide")
            assert page.locator(".reveal .slides section[id^='slide-']").count() == len(screens)
            page.wait_for_timeout(1000)  # images decoded, the slide centred
            page.screenshot(path=str(ARTIFACTS / "rise_slides.png"))

            measured, shot_fragment = {}, False
            for i, (section, fragment) in enumerate(expected):
                if i:
                    before = page.evaluate("location.hash")
                    page.keyboard.press("Space")  # next: slide, subslide or fragment, as a presenter steps
                    page.wait_for_function("h => location.hash !== h", arg=before, timeout=15_000)
                want = f"#/{section}" + ("" if fragment is None else f"/{fragment}")
                got = page.evaluate("location.hash")
                assert got == want, f"step {i}: reveal.js is at {got}, the metadata says {want}"
                if fragment is None:
                    measured[section] = page.evaluate("""id => { const cells = [...document.getElementById(id)
                        .querySelectorAll('.jp-Cell')].map(c => c.getBoundingClientRect());
                        return [cells.length, Math.max(...cells.map(r => r.bottom)) - Math.min(...cells.map(r => r.top))]; }""",
                                                      section)
                elif not shot_fragment:  # the first answer shown after its question
                    page.wait_for_timeout(800)
                    page.screenshot(path=str(ARTIFACTS / "rise_slides_fragment.png"))
                    shot_fragment = True
            assert shot_fragment, "the notebook has no fragment (a result after a question)"
            assert [n for n, _ in measured.values()] == [s.cells for s in screens]
            too_tall = {sid: round(h) for sid, (n, h) in measured.items() if n > 1 and h > height}
            assert not too_tall, f"screens of several cells taller than the {height} px window: {too_tall}"

            # the instructor's way: the notebook in JupyterLab, Alt+R (the RISE button in the notebook's toolbar)
            lab_page = browser.new_page(viewport={"width": 1400, "height": 900})
            lab_page.set_default_timeout(60_000)
            lab_page.goto(f"{base}/lab/tree/{notebook.name}?token={token}")
            expect(lab_page.locator(".jp-NotebookPanel-toolbar [data-command='RISE:preview']")).to_have_count(1,
                                                                                                            timeout=90_000)
            lab_page.locator(".jp-Notebook .jp-Cell").first.click()
            lab_page.keyboard.press("Escape")  # command mode, where Alt+R is bound
            lab_page.keyboard.press("Alt+r")
            frame = lab_page.frame_locator(f"iframe[src*='/rise/{notebook.name}']")
            expect(frame.locator(".reveal .slides section.present[id='slide-0-0']")).to_be_visible(timeout=90_000)
            lab_page.wait_for_timeout(1000)
            lab_page.screenshot(path=str(ARTIFACTS / "rise_in_jupyterlab.png"))
        finally:
            browser.close()


CHINESE_NOTEBOOK = ROOT / "notebooks" / "zh-CN" / "07_capstone.ipynb"


def test_a_chinese_notebook_renders_its_text_and_plots(lab, tmp_path):
    """The Chinese edition in JupyterLab: headings and prose in Chinese (drawn with the CJK font the page has),
    the committed plot (Chinese labels, drawn by matplotlib with Noto CJK) shown; screenshots for a human look."""
    from playwright.sync_api import expect, sync_playwright

    base, token = lab
    shutil.copy(CHINESE_NOTEBOOK, tmp_path / "notebooks" / CHINESE_NOTEBOOK.name)
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(60_000)
            page.goto(f"{base}/lab/tree/{CHINESE_NOTEBOOK.name}?token={token}")
            heading = page.locator(".jp-Notebook .jp-MarkdownOutput h1").first
            expect(heading).to_be_visible(timeout=90_000)
            assert re.search(r"[\u4e00-\u9fff]", heading.inner_text()), heading.inner_text()
            # a Chinese glyph is as wide as the CJK font makes it: a missing font would fall back to boxes/narrow glyphs
            width = page.evaluate("""() => { const s = document.createElement('span'); s.textContent = '显存显存显存';
                document.querySelector('.jp-MarkdownOutput').appendChild(s); const w = s.getBoundingClientRect().width;
                s.remove(); return w; }""")
            assert width > 40, f"six CJK characters are {width} px wide: is a CJK font installed?"
            page.screenshot(path=str(ARTIFACTS / "zh_notebook.png"))
            image = page.locator(".jp-Notebook .jp-RenderedImage img").first
            image.scroll_into_view_if_needed(timeout=60_000)
            page.wait_for_function("img => img.complete && img.naturalWidth > 100", arg=image.element_handle())
            image.screenshot(path=str(ARTIFACTS / "zh_plot.png"))
        finally:
            browser.close()
