"""The dashboard in a real browser: headless Chromium renders the page, and the numbers it shows match status.json.

Chromium (Debian's ``chromium`` package) loads the dashboard with a virtual-time budget, so the page's
script fetches ``status.json`` and renders before ``--dump-dom`` prints the DOM. Every shown number is
compared with the status document: the text in the page's format, and the raw ``data-value``.
Skipped, with the reason, where no Chromium binary is installed (``apt-get install chromium``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, Optional

import pytest

from asyncloco.coordinator.dashboard import DashboardServer, file_source
from asyncloco.coordinator.status import fixed as js_fixed  # JavaScript's toFixed, checked in test_status.py
from asyncloco.coordinator.status import last_metric

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "headless_shell")


def find_browser() -> Optional[str]:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


BROWSER = find_browser()
pytestmark = pytest.mark.skipif(
    BROWSER is None, reason=f"no Chromium binary found (looked for {', '.join(BROWSERS)}); apt-get install chromium"
)


class DomNumbers(HTMLParser):
    """Collects the elements the page fills in: by id, the peers' table cells, and the charts' point counts."""

    def __init__(self) -> None:
        super().__init__()
        self.by_id: dict[str, dict[str, Any]] = {}
        self.rows: dict[str, dict[str, dict[str, Any]]] = {}
        self.swarm: dict[str, dict[str, dict[str, Any]]] = {}  # the swarm table's rows, by "v<version>-<codec>"
        self.body: dict[str, Optional[str]] = {}
        self._row: Optional[str] = None
        self._table = self.rows
        self._open: Optional[dict[str, Any]] = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, Optional[str]]]) -> None:
        a = dict(attrs)
        if tag == "body":
            self.body = a
        if tag == "tr" and (a.get("data-peer") or a.get("data-swarm")):
            self._table = self.rows if a.get("data-peer") else self.swarm
            self._row = str(a.get("data-peer") or a.get("data-swarm"))
            self._table[self._row] = {"__class__": {"text": a.get("class") or ""}}
        if tag == "td" and self._row is not None and a.get("data-field"):
            self._open = {"text": "", "value": a.get("data-value")}
            self._table[self._row][str(a["data-field"])] = self._open
        elif a.get("id"):
            self._open = {"text": "", "value": a.get("data-value"), "points": a.get("data-points")}
            self.by_id[str(a["id"])] = self._open

    def handle_endtag(self, tag: str) -> None:
        if tag == "tr":
            self._row = None
        if tag in ("td", "div", "span", "svg"):
            self._open = None

    def handle_data(self, data: str) -> None:
        if self._open is not None:
            self._open["text"] += data


def render(url: str, tmp_path: Path) -> DomNumbers:
    """The DOM after the page's script ran (virtual time: its fetch and render happen before the dump)."""
    assert BROWSER is not None
    profile = tmp_path / "chromium-profile"
    args = [
        BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
        "--disable-dev-shm-usage", "--disable-breakpad", f"--user-data-dir={profile}", "--window-size=1280,1600",
        "--virtual-time-budget=5000", "--dump-dom", url,
    ]
    process = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True
    )
    try:
        out, err = process.communicate(timeout=90)
    finally:
        try:  # the browser's helpers share its process group: none may outlive the test
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if process.poll() is None:
            process.wait(timeout=10)
    assert process.returncode == 0, f"chromium exited with {process.returncode}: {err.decode(errors='replace')[-2000:]}"
    parser = DomNumbers()
    parser.feed(out.decode("utf-8"))
    return parser


def assert_page_matches(dom: DomNumbers, status: dict[str, Any]) -> None:
    assert dom.body.get("data-rendered-version") == str(status["version"]), "the page's script did not render"
    shown = {key: item["text"] for key, item in dom.by_id.items()}
    assert shown["run-id"] == status["run_id"] and shown["method"] == status["method"]
    assert shown["version"] == str(status["version"]) and int(dom.by_id["version"]["value"]) == status["version"]
    assert shown["local-updates"] == str(status["local_updates"])
    assert shown["updates-per-s"] == js_fixed(status["updates_per_s"], 2)
    assert float(dom.by_id["updates-per-s"]["value"]) == status["updates_per_s"]
    perplexity, loss = last_metric(status, "perplexity"), last_metric(status, "loss")
    if perplexity is not None:
        assert shown["metric-label"] == "validation perplexity" and shown["perplexity"] == js_fixed(perplexity, 2)
        assert float(dom.by_id["perplexity"]["value"]) == perplexity
    else:
        assert loss is not None
        assert shown["metric-label"] == "validation loss" and shown["perplexity"] == js_fixed(loss, 4)
        assert float(dom.by_id["perplexity"]["value"]) == loss
    peers = status["peers"]
    alive = sum(1 for row in peers.values() if row["alive"])
    assert shown["peers-alive"] == f"{alive}/{len(peers)}"
    assert shown["active-leases"] == str(status["active_leases"]) and shown["rejections"] == str(status["rejections"])
    # the charts hold one point per evaluation / history sample / peer
    evals = [e for e in status["evals"] if ("perplexity" if perplexity is not None else "loss") in e]
    assert dom.by_id["chart-ppl-time"]["points"] == str(len(evals))
    assert dom.by_id["chart-ppl-updates"]["points"] == str(len(evals))
    assert dom.by_id["chart-rate"]["points"] == str(len(status["history"]))
    for chart in ("chart-speed", "chart-steps", "chart-stale"):
        assert dom.by_id[chart]["points"] == str(len(peers))
    # the peers' table: one row per peer, every number as in status.json
    assert set(dom.rows) == set(peers)
    for peer_id, row in peers.items():
        cells = dom.rows[peer_id]
        assert cells["name"]["text"] == (row["name"] or "-") and cells["device"]["text"] == (row["device"] or "-")
        assert cells["id"]["text"] == peer_id[-10:]
        assert ("dead" in cells["__class__"]["text"]) == (not row["alive"])
        for field, digits in (("speed", 0), ("steps_per_lease", 1), ("mean_staleness", 2)):
            assert cells[field]["text"] == js_fixed(row[field], digits), field
            assert float(cells[field]["value"]) == row[field], field
        for field in ("last_steps", "leases", "applied"):
            assert cells[field]["text"] == str(row[field]) and int(cells[field]["value"]) == row[field], field
        if row["last_inner_loss"] is None:
            assert cells["last_inner_loss"]["text"] == "-" and cells["last_inner_loss"]["value"] == ""
        else:
            assert cells["last_inner_loss"]["text"] == js_fixed(row["last_inner_loss"], 4)
            assert float(cells["last_inner_loss"]["value"]) == row["last_inner_loss"]
        assert float(cells["last_seen"]["value"] or 0) == row["last_seen"]
    # verification and the θ swarm: "off" where the run does not use them
    verification = status.get("verification")
    if verification is None:
        assert shown["verified"] == "off" and dom.by_id["verified"]["value"] == "" and shown["expelled"] == "-"
    else:
        assert shown["verified"] == f"{verification['checked']} ({verification['failed']})"
        assert int(dom.by_id["verified"]["value"]) == verification["checked"]
        assert shown["expelled"] == str(len(verification["expelled"]))
    swarm = status.get("swarm")
    if swarm is None:
        assert shown["seed-bytes"] == "off" and dom.swarm == {}
    else:
        assert shown["seed-bytes"] == js_fixed(swarm["seed_bytes_sent"] / 1e6, 1) + " MB"
        assert int(dom.by_id["seed-bytes"]["value"]) == swarm["seed_bytes_sent"]
        assert set(dom.swarm) == {f"v{b['version']}-{b['codec']}" for b in swarm["bodies"]}
        for body in swarm["bodies"]:
            cells = dom.swarm[f"v{body['version']}-{body['codec']}"]
            assert cells["codec"]["text"] == body["codec"]
            for field, count in (("version", body["version"]), ("holders", len(body["holders"])),
                                 ("dropped", len(body["dropped"])), ("seed_copies", body["seed_copies"]),
                                 ("chunks", body["chunks"])):
                assert cells[field]["text"] == str(count) and int(cells[field]["value"]) == count, field


@pytest.mark.timeout(240)
def test_browser_shows_the_numbers_of_an_in_process_coordinator(tmp_path: Path) -> None:
    from test_status import drive_daemon

    daemon, _ = drive_daemon(tmp_path / "run")
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["peers"]["peer-a"]["last_inner_loss"] == 2.5  # the fixture's values are in play
    with DashboardServer(lambda: daemon.monitoring.stats.document_json) as server:
        dom = render(server.url, tmp_path)
    assert_page_matches(dom, status)
    assert dom.rows["peer-a"]["name"]["text"] == "alice" and dom.rows["peer-b"]["last_inner_loss"]["text"] == "-"


@pytest.mark.timeout(240)
def test_browser_shows_a_served_status_file_with_perplexity_and_a_departed_peer(tmp_path: Path) -> None:
    from test_status import FIXTURE

    # a run that verifies work and serves θ through its swarm (the shapes of DaemonVerification.status and
    # SwarmSeed.status)
    status = {
        **FIXTURE,
        "verification": {"fraction": 0.08, "probation_updates": 2, "tolerance": 0.0, "checked": 9, "failed": 1,
                         "passed": 8, "pending": 0, "unverifiable": 0, "expelled": {"QmMallory": "did not reproduce"},
                         "repairs": []},
        "swarm": {"bodies": [{"version": 6, "codec": "int8", "holders": ["QmPeerAAAAAAAAAAAAAAAAAlice1"], "dropped": [],
                              "seed_copies": 5, "chunks": 4},
                             {"version": 7, "codec": "int8", "holders": [], "dropped": ["QmMallory"], "seed_copies": 8,
                              "chunks": 4}],
                  "seed_bytes_sent": 2_345_678, "seed_chunks_sent": 13, "reports": []},
    }
    path = tmp_path / "status.json"
    path.write_text(json.dumps(status))
    with DashboardServer(file_source(path)) as server:
        dom = render(server.url, tmp_path)
    assert_page_matches(dom, status)
    assert (dom.by_id["verified"]["text"], dom.by_id["seed-bytes"]["text"]) == ("9 (1)", "2.3 MB")
    shown = {key: item["text"] for key, item in dom.by_id.items()}
    # the values written out, as a reader sees them
    assert (shown["perplexity"], shown["updates-per-s"], shown["peers-alive"]) == ("148.41", "0.12", "1/2")
    alice = dom.rows["QmPeerAAAAAAAAAAAAAAAAAlice1"]
    assert [alice[f]["text"] for f in ("speed", "last_steps", "steps_per_lease", "mean_staleness", "last_inner_loss")] == [
        "1235", "12", "10.0", "0.67", "3.1416",
    ]
