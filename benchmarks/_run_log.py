"""The run log: every finished run of a benchmark saved as it ends, so `--resume` can skip it."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from _reports import jsonable

from flashrl.checkpoints import fsync_path


class RunLog:
    """Finished runs, one JSON line each, next to the report (`<report>.runs.tmp`); append-only.

    A full benchmark takes hours: each run is appended (and fsynced) the moment it ends, so a crash, a
    stop or the end of a sitting loses at most the run in progress, and nothing already written is
    ever rewritten. The first line holds the settings the runs were made with. With `resume=True` the
    runs already in the log are kept and `get` returns them (keyed by `key_fields`, e.g. method and
    seed); a line cut short by a kill is skipped (that run is redone), and a log made with other
    settings is an error. Without `resume` a log that holds finished runs is NOT discarded unless
    `discard=True` (the scripts' `--discard-log`): a rerun without `--resume` would otherwise lose
    hours of runs.

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
        discard: bool = False,
    ) -> None:
        self.path = Path(f"{os.fspath(report_path)}.runs.tmp")
        self.key_fields = tuple(key_fields)
        self._runs: dict[tuple[Any, ...], dict[str, Any]] = {}
        settings = json.loads(json.dumps(jsonable({"settings": settings}), allow_nan=False))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            logged, runs = self._read()
            if resume:
                if logged is not None and logged != settings:
                    raise ValueError(
                        f"--resume: {self.path} was made with {logged['settings']}, this run has "
                        f"{settings['settings']}; run with the same settings, or without --resume "
                        "(and --discard-log) to start over"
                    )
                self._runs = runs
                if logged is not None:
                    self._end_line()
                    return
            elif runs and not discard:
                raise FileExistsError(
                    f"{self.path} holds {len(runs)} finished run(s) and this run has no --resume: expected "
                    "--resume to keep them, or --discard-log to start over (they are deleted then)"
                )
        elif resume and Path(report_path).exists():
            self._seed_from_report(Path(report_path), settings)
        self._create([settings, *self._runs.values()])

    def _read(self) -> tuple[dict[str, Any] | None, dict[tuple[Any, ...], dict[str, Any]]]:
        """The settings line and the runs of the log; unreadable lines (a kill mid-write) are skipped."""
        lines = self.path.read_text(encoding="utf-8").splitlines()
        logged = None
        runs: dict[tuple[Any, ...], dict[str, Any]] = {}
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                print(f"{self.path}:{number}: unreadable line ({error}); that run runs again", flush=True)
                continue
            if number == 1:
                logged = record
            else:
                runs[self._key(record)] = record
        return logged, runs

    def _create(self, records: Sequence[Mapping[str, Any]]) -> None:
        """A new log, whole or not at all: written beside it, fsynced, renamed over it."""
        tmp = self.path.with_name(self.path.name + ".new")
        with tmp.open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(record) + "\n" for record in records)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fsync_path(self.path.parent)

    def _end_line(self) -> None:
        """After a line cut short, the next run starts on a line of its own."""
        with self.path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return
            f.seek(-1, os.SEEK_END)
            ends = f.read(1) == b"\n"
        if not ends:
            with self.path.open("a", encoding="utf-8") as f:
                f.write("\n")

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
        """Append one finished run and fsync it before returning."""
        line = json.dumps(jsonable(run), allow_nan=False)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        self._runs[self._key(run)] = json.loads(line)

    def runs(self) -> list[dict[str, Any]]:
        """Every logged run, in the order they were added (a re-run replaces its earlier line)."""
        return list(self._runs.values())

    def __len__(self) -> int:
        return len(self._runs)
