"""Nothing is written outside the checkpoint directories and the paths a user passes.

Save, load (resharded too; also 128 MiB per rank), async save (forked and persistent
writers), the ('local', 2) backend, `LocalCheckpointManager` with replication,
`CheckpointManager`, and every `dist-ckpt` verb run in fresh processes whose HOME,
XDG_CACHE_HOME and TMPDIR are empty directories of this test (and without the variables
that point torch or an older version of this library elsewhere). Afterwards those directories, and the working directory the
processes ran in, must still be empty, and every path under the test's root must lie
inside a checkpoint or output path the test passed (or be a parent directory of one).
Processes that do not read each other's output run at the same time (each verb is still
its own process): the verbs that need no checkpoint of the ranks run while the ranks do,
and the verbs that read the ranks' checkpoints all at once after them.

The ranks' side is `_writes_stay_inside_ranks.py`, run as a script; the processes import
the `dist_checkpointing` of this tree (PYTHONPATH), not whatever is installed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Sequence

import pytest

REPO = Path(__file__).resolve().parents[2]
RANKS = Path(__file__).with_name("_writes_stay_inside_ranks.py")

#: variables that would send the library (or torch) somewhere other than HOME and TMPDIR
_UNSET = (
    "DIST_CKPT_CACHE_DIR",
    "XDG_CONFIG_HOME",
    "XDG_DATA_HOME",
    "XDG_STATE_HOME",
    "XDG_RUNTIME_DIR",
    "TORCH_HOME",
    "TORCHINDUCTOR_CACHE_DIR",
    "TRITON_CACHE_DIR",
    "TEMP",
    "TMP",
)

#: every `dist-ckpt` verb this test runs (compared with `dist-ckpt --help`)
VERBS = {"ls", "inspect", "verify", "convert", "diff", "export-hf", "import-hf", "demo"}


def _env(home: Path, cache: Path, tmp: Path) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _UNSET}
    env.update(
        HOME=str(home),
        XDG_CACHE_HOME=str(cache),
        TMPDIR=str(tmp),
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        PYTHONDONTWRITEBYTECODE="1",  # no __pycache__ in the source tree either
        OMP_NUM_THREADS="1",
        DIST_CKPT_TIMEOUT_S="60",  # a failing collective raises instead of waiting 600 s
    )
    return env


def _cli() -> List[str]:
    script = Path(sys.executable).with_name("dist-ckpt")
    return [str(script)] if script.exists() else [sys.executable, "-m", "dist_checkpointing"]


def _start(cmd: Sequence[str], env: Dict[str, str], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        list(cmd), env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _finish(proc: subprocess.Popen[str], timeout: float) -> str:
    """Waits for `proc` (killed after `timeout` s); fails the test unless it exited 0."""
    cmd = " ".join(proc.args) if isinstance(proc.args, list) else str(proc.args)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        pytest.fail(f"{cmd} did not finish within {timeout:.0f} s\nstderr:\n{stderr[-6000:]}")
    if proc.returncode != 0:
        pytest.fail(
            f"{cmd} exited {proc.returncode}\nstdout:\n{stdout[-4000:]}\nstderr:\n{stderr[-6000:]}"
        )
    return stdout


def _listing(d: Path) -> List[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


def _inside(p: Path, allowed: Sequence[Path]) -> bool:
    for a in allowed:
        if p == a or a in p.parents:
            return True
        if p in a.parents and p.is_dir() and not p.is_symlink():  # a parent it had to create
            return True
    return False


@pytest.mark.timeout(300)
def test_every_write_stays_inside_the_given_paths(tmp_path: Path) -> None:
    started: List[subprocess.Popen[str]] = []
    try:
        _check_writes(tmp_path, started)
    finally:  # 256 MiB nobody needs to keep; no process outlives a failed test
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        shutil.rmtree(tmp_path / "ckpt" / "big", ignore_errors=True)


def _check_writes(root: Path, started: List[subprocess.Popen[str]]) -> None:
    home, cache, tmp, cwd = (root / n for n in ("home", "xdg_cache", "tmpdir", "cwd"))
    for d in (home, cache, tmp, cwd):
        d.mkdir()
    env = _env(home, cache, tmp)
    ckpt, out = root / "ckpt", root / "out"
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()

    def start(*cmd: str) -> subprocess.Popen[str]:
        started.append(_start(cmd, env, cwd))
        return started[-1]

    # save, load, resharded load, async saves, local backend and managers on 2 fresh ranks
    ranks = start(sys.executable, str(RANKS), str(ckpt))

    # meanwhile, every dist-ckpt verb that needs none of the ranks' checkpoints, once each
    cli = _cli()
    help_proc = start(*cli, "--help")
    demo = [*cli, "demo", "--world-size", "2", "--hidden", "32", "--layers", "1", "--vocab", "64"]
    demo_proc = start(*demo, "--dir", str(out / "demo"))
    from tests.tools.test_hf import CONFIG, _gpt, _save

    gpt = _save(_gpt(moe=True, tied=False), ckpt / "gpt")  # a GPTModel-shaped checkpoint
    outputs = {}
    for args in (
        ["export-hf", str(gpt), str(out / "hf"), "--config", CONFIG],
        ["import-hf", str(out / "hf"), str(ckpt / "from_hf"), "--tp", "2"],
    ):
        outputs[args[0]] = json.loads(_finish(start(*cli, *args, "--json"), 60))
    help_text = _finish(help_proc, 60)
    listed = set(re.findall(r"^ {4}([a-z][\w-]*)\s", help_text, flags=re.M))
    assert listed == VERBS, f"dist-ckpt --help lists {sorted(listed)}: update this test"

    stdout = _finish(ranks, 150)
    pids = next(line.split()[1:] for line in stdout.splitlines() if line.startswith("PIDS "))

    sync = ckpt / "sync" / "iter_0000001"
    async_ckpt = ckpt / "async" / "iter_0000002"
    manager_root = ckpt / "manager" / "persistent"

    # the verbs that read the ranks' checkpoints, all at once
    reading = {
        "ls": start(*cli, "ls", str(manager_root), "--json"),
        "inspect": start(*cli, "inspect", str(sync), "--json"),
        "verify": start(*cli, "verify", str(sync), "--json"),
        "convert": start(
            *cli, "convert", str(sync), str(out / "safetensors"), "--to", "safetensors", "--json"
        ),
        "diff": start(*cli, "diff", str(sync), str(async_ckpt), "--json"),
    }
    outputs.update({verb: json.loads(_finish(proc, 60)) for verb, proc in reading.items()})
    _finish(demo_proc, 120)
    assert outputs["export-hf"]["tensors"] == 3 + 2 * (7 + 3 * 4), outputs["export-hf"]
    assert outputs["import-hf"]["files"] == [str(ckpt / "from_hf")], outputs["import-hf"]
    assert [e["step"] for e in outputs["ls"]] == [6, 4], outputs["ls"]
    assert outputs["inspect"]["complete"], outputs["inspect"]
    assert outputs["verify"]["ok"], outputs["verify"]
    assert outputs["convert"]["tensors"] == 1, outputs["convert"]
    assert outputs["diff"]["equal"], outputs["diff"]

    problems: List[str] = []
    # HOME, XDG_CACHE_HOME, TMPDIR and the working directory are still empty
    for name, d in (("HOME", home), ("XDG_CACHE_HOME", cache), ("TMPDIR", tmp), ("cwd", cwd)):
        found = _listing(d)
        if found:
            problems.append(f"{name} {d} is not empty: {found}")

    # everything else under the root lies inside a path the test passed
    allowed = [
        sync,
        ckpt / "big" / "iter_0000001",
        async_ckpt,
        ckpt / "async" / "iter_0000003",
        *(ckpt / f"node_{r}" / "iter_0000100" for r in (0, 1)),
        *(ckpt / "localmgr" / f"rank_{r}" for r in (0, 1)),
        manager_root,
        ckpt / "manager" / "local",
        out / "safetensors",
        out / "demo",
        ckpt / "gpt",
        out / "hf",
        ckpt / "from_hf",
        home,
        cache,
        tmp,
        cwd,
    ]
    stray = sorted(str(p.relative_to(root)) for p in root.rglob("*") if not _inside(p, allowed))
    if stray:
        problems.append(f"outside the paths the test passed, under {root}: {stray}")

    # no shared-memory file of these processes is left behind
    if os.path.isdir("/dev/shm"):
        new = set(os.listdir("/dev/shm")) - shm_before
        ours = sorted(n for n in new if set(re.split(r"[^0-9A-Za-z]+", n)) & set(pids))
        if ours:
            problems.append(f"left in /dev/shm by processes {pids}: {ours}")

    if problems:
        pytest.fail("written outside the checkpoint directories:\n" + "\n".join(problems))
