"""The run log: every finished run of a benchmark saved as it ends, so `--resume` can skip it."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from _reports import jsonable


class RunLog:
    """Finished runs, one JSON line each, next to the report (`<report>.runs.tmp`).

    A full benchmark takes hours: each run is written the moment it ends, so a crash, a stop or the
    end of a sitting loses at most the run in progress. The first line holds the settings the runs
    were made with. With `resume=True` the runs already in the log are kept and `get` returns them
    (keyed by `key_fields`, e.g. method and seed), and a log made with other settings is an error;
    without it the log starts empty.

    The log is not committed, so a fresh clone has none: there `resume=True` starts from the runs of
    the committed report itself (`report_path`), when the report's `settings` hold these settings
    (same keys, same values), so a later sitting adds seeds or arms to a published report instead of
    redoing it. A report made with other settings is an error, as a log would be.

    `settings` are the benchmark's own run parameters (its scale, its flags: the report's `settings`
    key), not the reference's experiment settings.
    """

    def __init__(
        self,
        report_path: str | os.PathLike[str],
        *,
        key_fields: Sequence[str],
        settings: Mapping[str, Any],
        resume: bool,
    ) -> None:
        self.path = Path(f"{os.fspath(report_path)}.runs.tmp")
        self.key_fields = tuple(key_fields)
        self._runs: dict[tuple[Any, ...], dict[str, Any]] = {}
        settings = json.loads(json.dumps(jsonable({"settings": settings}), allow_nan=False))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume and not self.path.exists() and Path(report_path).exists():
            self._seed_from_report(Path(report_path), settings)
        elif resume and self.path.exists():
            lines = self.path.read_text(encoding="utf-8").splitlines()
            logged = json.loads(lines[0]) if lines else settings
            if logged != settings:
                raise ValueError(
                    f"--resume: {self.path} was made with {logged['settings']}, this run has "
                    f"{settings['settings']}; run with the same settings, or without --resume to start over"
                )
            for number, line in enumerate(lines[1:], 2):
                try:
                    run = json.loads(line)
                except json.JSONDecodeError as error:  # a line cut short by a kill: that run is redone
                    print(f"{self.path}:{number}: unreadable run ({error}); it runs again", flush=True)
                    continue
                self._runs[self._key(run)] = run
        # rewritten whole, so a line cut short is gone before the next run is appended
        kept = [json.dumps(settings), *(json.dumps(run) for run in self._runs.values())]
        self.path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")

    def _seed_from_report(self, report_path: Path, settings: Mapping[str, Any]) -> None:
        report = json.loads(report_path.read_text(encoding="utf-8"))
        made_with = report.get("settings", {})
        mine = {k: made_with.get(k) for k in settings["settings"]}
        if mine != settings["settings"]:
            raise ValueError(
                f"--resume: {report_path} was made with {mine}, this run has {settings['settings']}; "
                "run with the same settings, or without --resume to start over"
            )
        for run in report.get("runs", []):
            self._runs[self._key(run)] = run
        print(f"--resume: {len(self._runs)} finished run(s) from {report_path}", flush=True)

    def _key(self, run: Mapping[str, Any]) -> tuple[Any, ...]:
        return tuple(run[k] for k in self.key_fields)

    def get(self, **key: Any) -> dict[str, Any] | None:
        """The logged run with these key values, or None."""
        return self._runs.get(tuple(key[k] for k in self.key_fields))

    def add(self, run: Mapping[str, Any]) -> None:
        line = json.dumps(jsonable(run), allow_nan=False)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")
        self._runs[self._key(run)] = json.loads(line)

    def __len__(self) -> int:
        return len(self._runs)
