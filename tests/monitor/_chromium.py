"""A headless Chromium driven over the DevTools protocol: open a page, read its state, screenshot.

Bokeh draws on canvases from data it receives over a websocket, so the DOM of a dashboard page
says nothing about its curves; the page's own Bokeh document does. This driver evaluates
JavaScript in the page (``Runtime.evaluate``) to read it, and takes screenshots
(``Page.captureScreenshot``). Debian's ``chromium`` package; the websocket client is tornado's
(a dependency of distributed). Used by the tests and by ``docs/make_screenshot.py``.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.request import urlopen

from tornado.websocket import websocket_connect

# Reads every Bokeh data source named "src-..." on the page: name -> number of points.
POINTS_JS = """(() => {
  if (!window.Bokeh || !Bokeh.documents || !Bokeh.documents.length) return null;
  const out = {};
  for (const m of Bokeh.documents[0].all_models) {
    if (!m.name || !m.name.startsWith('src-')) continue;
    const d = m.data, col = d instanceof Map ? (d.get('x') || d.get('text')) : (d.x || d.text);
    out[m.name] = col ? col.length : 0;
  }
  return JSON.stringify(out);
})()"""

# The text of the page's headline (a Bokeh Div named "headline").
HEADLINE_JS = """(() => {
  if (!window.Bokeh || !Bokeh.documents || !Bokeh.documents.length) return null;
  const m = Bokeh.documents[0].get_model_by_name('headline');
  return m ? m.text : null;
})()"""


def chromium_path() -> str | None:
    """The Chromium executable, or None when it is not installed."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Chromium:
    """``async with Chromium() as browser:`` a headless browser with one page.

    Parameters
    ----------
    width, height : int
        The window (and screenshot) size in CSS pixels.
    timeout : float
        Longest wait for the browser to start and for each protocol call.
    """

    def __init__(self, *, width: int = 1500, height: int = 1150, timeout: float = 60.0) -> None:
        self.width, self.height, self.timeout = width, height, timeout
        self.ids = itertools.count(1)
        self.proc: subprocess.Popen[bytes] | None = None
        self.conn: Any = None
        self.profile = tempfile.TemporaryDirectory(prefix="dt-chromium-", ignore_cleanup_errors=True)

    async def __aenter__(self) -> Chromium:
        exe = chromium_path()
        if exe is None:
            raise RuntimeError("chromium is not installed: apt-get install -y chromium")
        self.proc = subprocess.Popen(
            [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--hide-scrollbars", "--remote-debugging-port=0", "--no-first-run",
             f"--user-data-dir={self.profile.name}",
             f"--window-size={self.width},{self.height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port = await self._port()
        targets = json.loads(urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10).read())
        page = next(t for t in targets if t.get("type") == "page")
        self.conn = await asyncio.wait_for(
            websocket_connect(page["webSocketDebuggerUrl"], max_message_size=256 * 2**20),
            self.timeout)
        await self.call("Page.enable")
        return self

    async def _port(self) -> int:
        # Chromium writes the port it chose to this file once it listens.
        marker = Path(self.profile.name) / "DevToolsActivePort"
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if marker.exists() and marker.read_text().strip():
                return int(marker.read_text().split()[0])
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode}")
            await asyncio.sleep(0.1)
        raise TimeoutError(f"chromium did not start within {self.timeout:g} s")

    async def __aexit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        if self.conn is not None:
            # Leave the page first: a Bokeh server logs an error for messages of a session whose
            # websocket was cut mid-flight (a killed browser).
            try:
                await self.call("Page.navigate", url="about:blank")
                await asyncio.sleep(0.5)
                await self.call("Browser.close")
            except Exception:
                pass  # it is closing anyway
            self.conn.close()
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        # Chromium's helper processes may still write to the profile for a moment after the
        # browser exits: retry until the folder is gone.
        for _ in range(20):
            shutil.rmtree(self.profile.name, ignore_errors=True)
            if not Path(self.profile.name).exists():
                break
            await asyncio.sleep(0.25)
        self.profile.cleanup()

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        """One protocol call; its result (events received meanwhile are dropped)."""
        ident = next(self.ids)
        await self.conn.write_message(json.dumps({"id": ident, "method": method, "params": params}))
        deadline = time.monotonic() + self.timeout
        while True:
            raw = await asyncio.wait_for(self.conn.read_message(), deadline - time.monotonic())
            if raw is None:
                raise ConnectionError("the browser closed the DevTools connection")
            msg = json.loads(raw)
            if msg.get("id") == ident:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                result: dict[str, Any] = msg.get("result", {})
                return result

    async def goto(self, url: str) -> None:
        """Open ``url`` in the page."""
        await self.call("Page.navigate", url=url)

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page."""
        reply = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in reply:
            details = reply["exceptionDetails"]
            raise RuntimeError(f"JavaScript error: {details.get('exception', {}).get('description')}"
                               f" ({details.get('text')})")
        return reply.get("result", {}).get("value")

    async def wait_for(self, expression: str, check: Any, *, timeout: float) -> Any:
        """Evaluate ``expression`` until ``check(value)`` is true; its last value."""
        deadline = time.monotonic() + timeout
        value = None
        while time.monotonic() < deadline:
            value = await self.evaluate(expression)
            if value is not None and check(value):
                return value
            await asyncio.sleep(0.25)
        raise TimeoutError(f"the page never satisfied the check within {timeout:g} s; "
                           f"last value: {value!r}")

    async def points(self) -> dict[str, int]:
        """Points per data source of the Training page (``src-<name>`` -> count)."""
        value = await self.evaluate(POINTS_JS)
        return json.loads(value) if value else {}

    async def screenshot(self, path: str | Path) -> Path:
        """Save the page as a PNG."""
        reply = await self.call("Page.captureScreenshot", format="png")
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(base64.b64decode(reply["data"]))
        return out
