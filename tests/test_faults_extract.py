"""Fault injection on extraction, at tiny sizes: kill -9 at random points, same-size corruption of shards, and a
disk that fills up at each kind of write. Each ends, after one plain re-run, in the folder an uninterrupted run
writes, byte for byte.

Runs are forked from one driver process (this file run as a script) that imported torch, transformers and
eaglet once: a run then costs about a second instead of a fresh interpreter's ten. The driver never runs a
torch op itself, so each forked child starts with clean thread pools.
"""

from __future__ import annotations

import glob
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest
from volumes import small_volume

from eaglet.config import shared_data_dir
from eaglet.errors import DataError
from eaglet.shards import ShardReader

SHARED = shared_data_dir()
PAGE = 4096
SEED = 18


@dataclass
class Run:
    rc: int
    killed: bool
    seconds: float
    stderr: str


class Driver:
    """The forking driver, spoken to one JSON line per run."""

    def __init__(self, scratch: Path, cache: Path, data: Path) -> None:
        self.scratch, self.cache, self.data = scratch, cache, data
        self.runs = 0
        src = str(Path(__import__("eaglet").__file__).parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen(
            [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )

    def run(
        self,
        out: Path,
        *extra: str,
        kill: dict | None = None,
        leave: int | None = None,
        data_dir: Path | None = None,
    ) -> Run:
        """Extract into `out`, SIGKILLed at `kill`, or with `leave` bytes free once the disk check passed."""
        self.runs += 1
        stderr = self.scratch / f"stderr-{self.runs}.txt"
        data_dir = data_dir or out.parent / "data"
        request = {
            "overrides": [*overrides(self.data, out, self.cache), f"paths.data_dir={data_dir}", *extra],
            "kill": kill,
            "leave": leave,
            "stderr": str(stderr),
        }
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the driver ended (rc {self.proc.poll()})"
        reply = json.loads(line)
        return Run(reply["rc"], reply["killed"], reply["seconds"], stderr.read_text())

    def close(self) -> None:
        assert self.proc.stdin
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def overrides(data: Path, out: Path, cache: Path) -> list[str]:
    return [
        "model=tiny_llama",
        "dataset=jsonl",
        f"dataset.paths=[{data}]",
        "extract.regenerate.enabled=false",
        f"extract.output_dir={out}",
        "extract.max_length=256",
        "extract.shard_tokens=150",
        "extract.batch_tokens=512",
        f"paths.cache_dir={cache}",
    ]


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Any:
    scratch = tmp_path_factory.mktemp("faults")
    rows = (SHARED / "oasst_en100.jsonl").read_text().splitlines()[:24]
    data = scratch / "d.jsonl"
    data.write_text("\n".join(rows) + "\n")
    driver = Driver(scratch, model_cache, data)
    yield driver
    driver.close()


@pytest.fixture(scope="module")
def reference(driver: Driver, tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """Every file of an uninterrupted run's folder."""
    out = tmp_path_factory.mktemp("reference") / "out"
    done = driver.run(out)
    assert done.rc == 0, done.stderr
    files = contents(out)
    assert sum(name.startswith("shard-") for name in files) >= 20
    return files


def contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def one_error(run: Run) -> str:
    """The run's one message: rc 2 and a single `error:` line, no traceback."""
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert run.rc == 2 and len(errors) == 1 and "Traceback" not in run.stderr, run.stderr
    return errors[0]


def pages(size: int) -> int:
    return -(-size // PAGE) * PAGE


@pytest.mark.faults
def test_kill_9_at_random_points_resumes_to_the_same_folder(
    driver: Driver, reference: dict[str, bytes], tmp_path: Path
) -> None:
    rng = random.Random(SEED)
    out = tmp_path / "out"
    kills = 0
    for _ in range(30):
        if kills >= 10:
            break
        # Each kill waits for a file to be written during the run (or for a plain delay), then a random moment.
        trigger = rng.choice(["delay", "shard", "shard", "temporary", "manifest", "head"])
        if trigger == "head" and (out / "target_head.safetensors").exists():
            trigger = "shard"
        if trigger == "delay":  # anywhere: loading, tokenizing, verifying, writing
            kill: dict = {"after_s": rng.uniform(0.0, 2.5)}
        else:
            when = {
                "shard": "shard-*",
                "temporary": ".*.tmp-*",  # in the middle of an atomic write
                "manifest": "manifest.json",
                "head": "target_head.safetensors",
            }[trigger]
            kill = {"when": str(out / when), "then_s": rng.uniform(0.0, 0.03)}
        run = driver.run(out, kill=kill)
        if run.killed:
            kills += 1
        else:
            assert run.rc == 0, run.stderr
            shutil.rmtree(out)  # finished before the kill: start over, so later kills still land mid-run
    assert kills >= 10
    done = driver.run(out)
    assert done.rc == 0 and not done.killed, done.stderr
    assert contents(out) == reference


@pytest.mark.faults
def test_same_size_corruption_is_found_by_checksum_and_repaired(
    driver: Driver, reference: dict[str, bytes], tmp_path: Path
) -> None:
    rng = random.Random(SEED)
    out = tmp_path / "out"
    shards = sorted(name for name in reference if name.startswith("shard-"))
    for _ in range(3):
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        for name, data in reference.items():
            (out / name).write_bytes(data)
        for name in rng.sample(shards, rng.randint(1, 3)):
            damaged = bytearray(reference[name])
            for _ in range(rng.randint(1, 4)):
                damaged[rng.randrange(len(damaged))] ^= rng.randint(1, 255)
            (out / name).write_bytes(bytes(damaged))
        with pytest.raises(DataError, match="rewrites damaged shards"):
            ShardReader(out, verify=True)
        done = driver.run(out)
        assert done.rc == 0, done.stderr
        assert contents(out) == reference


def manifest_bytes(manifest: dict) -> int:
    """Size of `manifest` as written (atomic_write_json's form)."""
    return len(json.dumps(manifest, indent=2, sort_keys=True)) + 1


@pytest.mark.faults
def test_a_full_disk_at_each_write_says_so_once_and_leaves_only_complete_files(
    driver: Driver, reference: dict[str, bytes], tmp_path: Path
) -> None:
    head, counts = reference["target_head.safetensors"], reference["token_counts.safetensors"]
    final = json.loads(reference["manifest.json"])
    first = {**final, "status": "in_progress", "shards": [], "totals": {}, "token_counts_file": None}
    last = {**first, "shards": final["shards"]}
    shards = sum(pages(len(data)) for name, data in reference.items() if name.startswith("shard-"))
    written = shards + pages(len(head)) + pages(manifest_bytes(last))
    # Free bytes left once the disk check passed, each one page short of the write named.
    started = pages(manifest_bytes(first)) + pages(len(head))
    cases = [
        ("manifest.json", 0),  # the first one
        ("target_head.safetensors", started - PAGE),
        ("shard-", started + pages(len(reference["shard-00000.safetensors"])) - PAGE),
        ("token_counts.safetensors", written + pages(len(counts)) - PAGE),
        ("manifest.json", written + pages(len(counts)) + pages(manifest_bytes(final)) - PAGE),  # the last one
    ]
    with small_volume(tmp_path / "vol", 64 << 20) as volume:
        out = volume / "out"
        for failing, leave in cases:
            shutil.rmtree(out, ignore_errors=True)
            run = driver.run(out, leave=leave)
            message = one_error(run)
            assert f"no space left on device writing {out / failing}" in message, message
            assert "extract.output_dir" in message and "free in" in message
            left = contents(out)
            for name, data in left.items():
                assert name in reference, f"{name} left behind"
                if name != "manifest.json":
                    assert data == reference[name], f"{name} is not complete"
            if "manifest.json" in left:
                assert json.loads(left["manifest.json"])["status"] == "in_progress"
            (volume / "ballast").unlink()
            done = driver.run(out)
            assert done.rc == 0, done.stderr
            assert contents(out) == reference


@pytest.mark.faults
def test_a_full_disk_while_regenerating_keeps_whole_answers(driver: Driver, tmp_path: Path) -> None:
    regen = ["extract.regenerate.enabled=true", "extract.regenerate.max_new_tokens=4"]
    out = tmp_path / "out"
    with small_volume(tmp_path / "vol", 1 << 20) as volume:
        # The answers (about 11 KiB) go under paths.data_dir, here on the small volume with one page free: the
        # append that fills it is cut back, so the file holds whole records only.
        ballast = volume / "ballast"
        ballast.write_bytes(b"\0" * (shutil.disk_usage(volume).free - PAGE))
        run = driver.run(out, *regen, data_dir=volume / "data")
        message = one_error(run)
        assert "paths.data_dir" in message and f"writing {volume / 'data' / 'regenerated'}" in message
        (answers,) = (volume / "data" / "regenerated").iterdir()
        text = answers.read_bytes()
        assert not text or text.endswith(b"\n"), "a partial record was left"
        assert all(json.loads(line)["prompt_hash"] for line in text.splitlines())
        ballast.unlink()
        done = driver.run(out, *regen, data_dir=volume / "data")
        assert done.rc == 0, done.stderr


# The driver: a process that imports once and forks one child per run.


def _serve() -> None:
    import eaglet.extract.stage  # noqa: F401  (imported once, before any fork)

    for line in sys.stdin:
        print(json.dumps(_supervise(json.loads(line))), flush=True)


def _written(pattern: str) -> set[tuple[str, int, int]]:
    """The files matching `pattern` as (path, inode, mtime): a file written anew changes its entry."""
    found = set()
    for path in glob.glob(pattern):
        try:
            stat = os.stat(path)
        except FileNotFoundError:
            continue
        found.add((path, stat.st_ino, stat.st_mtime_ns))
    return found


def _supervise(request: dict) -> dict:
    """Run one child; SIGKILL it once its `kill` trigger fires: a delay, or a file written during the run."""
    kill, fire_at, status = request["kill"], None, None
    before = _written(kill["when"]) if kill and "when" in kill else set()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(request)
    while status is None:
        done, waited = os.waitpid(pid, os.WNOHANG)
        now = time.monotonic() - start
        if done:
            status = waited
        elif kill and fire_at is None:
            if "after_s" in kill:
                fire_at = kill["after_s"]
            elif _written(kill["when"]) - before:
                fire_at = now + kill["then_s"]
        if status is None and (fire_at is not None and now >= fire_at or now > 300):
            os.kill(pid, signal.SIGKILL)
            status = os.waitpid(pid, 0)[1]
        time.sleep(0.001)
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    return {"rc": os.waitstatus_to_exitcode(status), "killed": killed, "seconds": time.monotonic() - start}


def _child(request: dict) -> NoReturn:
    code = 1
    try:
        os.dup2(os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        if request["leave"] is not None:
            _fill_after_the_disk_check(request["leave"])
        _extract(request["overrides"])
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _extract(overrides: list[str]) -> None:
    """What extract.py does, on a config composed as the tests' compose fixture does."""
    import hydra

    import eaglet.config
    from eaglet.cli import user_errors
    from eaglet.extract.report import print_summary
    from eaglet.extract.stage import run_extraction

    @user_errors
    def main() -> None:
        with hydra.initialize_config_dir(config_dir=str(eaglet.config.CONF_DIR), version_base="1.3"):
            cfg = hydra.compose("config", overrides=overrides)
        eaglet.config.check_config(cfg)
        print_summary(run_extraction(cfg))

    main()


def _fill_after_the_disk_check(leave: int) -> None:
    """Another writer fills the disk right after the check passed, leaving `leave` bytes free."""
    from eaglet.extract import core

    check = core._check_disk

    def check_then_fill(out_dir: Path, sizes: Any, *budget: Any) -> int:
        needed = check(out_dir, sizes, *budget)
        with open(out_dir.parent / "ballast", "wb") as ballast:
            ballast.write(b"\0" * (shutil.disk_usage(out_dir).free - leave))
        return needed

    core._check_disk = check_then_fill


if __name__ == "__main__":
    _serve()
