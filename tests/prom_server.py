"""Real Prometheus and Alertmanager processes for tests, on free 127.0.0.1 ports.

Each class is a context manager that starts the Debian binary with a throwaway storage dir,
waits for /-/ready, and always terminates the process on exit (no leftovers between tests).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from conftest import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from bench_series import rules_every  # noqa: E402  (the rule files' copies evaluated at another interval)

PROMETHEUS_BIN = shutil.which("prometheus") or "/usr/bin/prometheus"
ALERTMANAGER_BIN = (
    shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
    or "/usr/bin/prometheus-alertmanager"
)

# The job name the fixture gives scrape_targets; the shipped deploy/prometheus/prometheus.yml
# uses the same one, so rules and dashboards see identical labels here and in production.
SCRAPE_JOB = "tensorwatch"

_START_TIMEOUT = 30.0
_STOP_TIMEOUT = 10.0
# Binding happens after free_port() released the port, so another process can grab it in
# between; on that (rare) race the start is retried on a new port.
_START_ATTEMPTS = 3


def _http_get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read()


class _ManagedProcess:
    """Start a server binary, wait for /-/ready, keep its log, always stop it."""

    name = "server"

    def __init__(self, tmp_path: os.PathLike) -> None:
        self._tmp_path = Path(tmp_path)
        self._proc: Optional[subprocess.Popen] = None
        self._log_path: Optional[Path] = None
        self.port: int = 0
        self.url: str = ""
        self.workdir: Path = self._tmp_path

    # -- subclass hooks ------------------------------------------------------------------
    def _prepare(self, workdir: Path) -> None:
        """Write config files into workdir (called once per start attempt)."""

    def _argv(self, workdir: Path, port: int) -> List[str]:
        raise NotImplementedError

    # -- lifecycle -------------------------------------------------------------------------
    def log_tail(self, chars: int = 4000) -> str:
        if self._log_path is None or not self._log_path.exists():
            return "(no log)"
        data = self._log_path.read_bytes()[-chars:]
        return data.decode("utf-8", "replace")

    def start(self) -> "_ManagedProcess":
        last_error = ""
        for _ in range(_START_ATTEMPTS):
            port = free_port()
            workdir = self._tmp_path / f"{self.name}-{port}"
            workdir.mkdir(parents=True, exist_ok=True)
            self._prepare(workdir)
            self.workdir, self.port = workdir, port
            self.url = f"http://127.0.0.1:{port}"
            self._log_path = workdir / "server.log"
            with open(self._log_path, "wb") as log:
                self._proc = subprocess.Popen(
                    self._argv(workdir, port), stdout=log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, cwd=workdir,
                )
            try:
                self._wait_ready()
                return self
            except _PortTaken as exc:
                last_error = str(exc)
                self.stop()
                continue
            except BaseException:
                self.stop()
                raise
        raise RuntimeError(f"{self.name} could not bind a port after {_START_ATTEMPTS} "
                           f"attempts:\n{last_error}")

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT
        while True:
            assert self._proc is not None
            code = self._proc.poll()
            if code is not None:
                tail = self.log_tail()
                if "address already in use" in tail:
                    raise _PortTaken(tail)
                raise RuntimeError(f"{self.name} exited with code {code} before it was ready; "
                                   f"log tail:\n{tail}")
            try:
                _http_get(self.url + "/-/ready", timeout=1.0)
                return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready at {self.url} after "
                                   f"{_START_TIMEOUT:.0f}s; log tail:\n{self.log_tail()}")
            time.sleep(0.1)

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=_STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=_STOP_TIMEOUT)

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class _PortTaken(RuntimeError):
    pass


class PrometheusServer(_ManagedProcess):
    """A real Prometheus scraping `scrape_targets` ("host:port", job "tensorwatch").

    `rule_files` are paths, loaded as copies whose groups are evaluated every `rule_interval`
    (the shipped groups' own 5 s and 15 s made every alert test wait for them; None: as
    shipped); `alertmanager_url` ("http://127.0.0.1:PORT") is where firing alerts go;
    `extra_scrape_configs` are appended verbatim.
    """

    name = "prometheus"

    def __init__(self, tmp_path: os.PathLike, scrape_targets: Sequence[str] = (),
                 rule_files: Sequence[os.PathLike] = (), alertmanager_url: Optional[str] = None,
                 scrape_interval: str = "1s", evaluation_interval: str = "1s",
                 extra_scrape_configs: Sequence[Dict[str, Any]] = (), rule_interval: Optional[str] = "1s") -> None:
        super().__init__(tmp_path)
        self.scrape_targets = list(scrape_targets)
        self.shipped_rule_files = [Path(p).resolve() for p in rule_files]
        self.rule_interval = rule_interval
        self.rule_files = [str(p) for p in self.shipped_rule_files]
        self.alertmanager_url = alertmanager_url
        self.scrape_interval = scrape_interval
        self.evaluation_interval = evaluation_interval
        self.extra_scrape_configs = [dict(c) for c in extra_scrape_configs]
        self.config_path: Optional[Path] = None

    def config(self) -> Dict[str, Any]:
        cfg: Dict[str, Any] = {
            "global": {"scrape_interval": self.scrape_interval,
                       "evaluation_interval": self.evaluation_interval},
            "rule_files": self.rule_files,
            "scrape_configs": [],
        }
        if self.scrape_targets:
            cfg["scrape_configs"].append({
                "job_name": SCRAPE_JOB,
                "static_configs": [{"targets": self.scrape_targets}],
            })
        cfg["scrape_configs"].extend(self.extra_scrape_configs)
        if self.alertmanager_url:
            parsed = urllib.parse.urlsplit(self.alertmanager_url)
            am: Dict[str, Any] = {"scheme": parsed.scheme or "http",
                                  "static_configs": [{"targets": [parsed.netloc]}]}
            if parsed.path.strip("/"):
                am["path_prefix"] = parsed.path
            cfg["alerting"] = {"alertmanagers": [am]}
        return cfg

    def _prepare(self, workdir: Path) -> None:
        if self.rule_interval is not None:
            rules_dir = workdir / "rules"
            rules_dir.mkdir(exist_ok=True)
            self.rule_files = [rules_every(str(p), self.rule_interval, str(rules_dir)) for p in self.shipped_rule_files]
        self.config_path = workdir / "prometheus.yml"
        # JSON is YAML; this keeps the fixture free of a YAML dependency.
        self.config_path.write_text(json.dumps(self.config(), indent=2))

    def _argv(self, workdir: Path, port: int) -> List[str]:
        return [
            PROMETHEUS_BIN,
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ]

    # -- HTTP API --------------------------------------------------------------------------
    def _api(self, path: str, params: Optional[Dict[str, str]] = None) -> Any:
        url = self.url + path
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            body = _http_get(url, timeout=10.0)
        except urllib.error.HTTPError as exc:  # 400/422 carry the PromQL error as JSON
            raw = exc.read().decode("utf-8", "replace")
            try:
                err = json.loads(raw)
                msg = f"{err.get('errorType')}: {err.get('error')}"
            except ValueError:
                msg = raw
            raise RuntimeError(f"Prometheus {path} {params or ''} failed: {msg}") from None
        doc = json.loads(body)
        if doc.get("status") != "success":
            raise RuntimeError(f"Prometheus {path} {params or ''} failed: "
                               f"{doc.get('errorType')}: {doc.get('error')}")
        return doc["data"]

    def query(self, promql: str) -> List[Dict[str, Any]]:
        """Instant query now; returns data.result (raises with Prometheus' error text)."""
        data = self._api("/api/v1/query", {"query": promql})
        result = data["result"]
        # Scalars and strings come back as [ts, value]; wrap them so callers see a list.
        if data.get("resultType") in ("scalar", "string"):
            return [{"metric": {}, "value": result}]
        return result

    def wait_for(self, promql: str,
                 predicate: Callable[[List[Dict[str, Any]]], bool] = lambda result: bool(result),
                 timeout: float = 30.0) -> List[Dict[str, Any]]:
        """Poll `promql` until predicate(result) holds; AssertionError with context on timeout."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while True:
            if not self.alive():
                raise AssertionError(f"Prometheus died while waiting for {promql!r}; "
                                     f"log tail:\n{self.log_tail()}")
            last = self.query(promql)
            if predicate(last):
                return last
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out after {timeout:.1f}s waiting for {promql!r}; last result: "
                    f"{json.dumps(last)[:2000]}\nPrometheus log tail:\n{self.log_tail()}")
            time.sleep(0.2)

    def alerts(self) -> List[Dict[str, Any]]:
        """Active alerts (pending and firing) from /api/v1/alerts."""
        return self._api("/api/v1/alerts")["alerts"]

    def targets(self) -> List[Dict[str, Any]]:
        """Active scrape targets, handy when a wait times out because nothing is scraped."""
        return self._api("/api/v1/targets")["activeTargets"]


class AlertmanagerServer(_ManagedProcess):
    """A real Alertmanager with `config_text` as its configuration, no cluster gossip."""

    name = "alertmanager"

    def __init__(self, tmp_path: os.PathLike, config_text: str) -> None:
        super().__init__(tmp_path)
        self.config_text = config_text
        self.config_path: Optional[Path] = None

    def _prepare(self, workdir: Path) -> None:
        self.config_path = workdir / "alertmanager.yml"
        self.config_path.write_text(self.config_text)

    def _argv(self, workdir: Path, port: int) -> List[str]:
        return [
            ALERTMANAGER_BIN,
            f"--config.file={self.config_path}",
            f"--storage.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            # Empty disables the gossip listener, which would otherwise want port 9094.
            "--cluster.listen-address=",
        ]

    def alerts(self) -> List[Dict[str, Any]]:
        """Alerts Alertmanager holds now (/api/v2/alerts)."""
        return json.loads(_http_get(self.url + "/api/v2/alerts"))
