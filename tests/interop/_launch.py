"""Finding and launching megatron-core beside our tests (shared by every interop test).

megatron-core never runs inside the pytest process: each interop test starts a side script
(`mcore_side.py`, `mcore013_side.py`, `mcore_model_side.py`) with an interpreter that has
the wanted megatron-core version, in its own process group (megatron leaves helper
processes behind; the whole group is ended), and reads back what it wrote.

Interpreters, each probed once per session (a probe starts an interpreter that imports torch
and megatron: seconds each, so the answers are cached, the module checks of one interpreter
share one start, and a session that collects the interop tests starts every probe at once
as collection begins: `probe_all_in_background`); a test skips with a reason when its one
is missing:
- megatron-core 0.16: `DIST_CKPT_MCORE_PYTHON`, else this interpreter when it can import
  `megatron.core` (e.g. megatron-core installed in a folder on PYTHONPATH).
- megatron-core 0.13: `DIST_CKPT_MCORE013_PYTHON`.
- megatron-core 0.19: `DIST_CKPT_MCORE19_PYTHON` with `DIST_CKPT_MCORE19_PATH` (its unpacked
  wheels) as PYTHONPATH.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import Future
from typing import Any, Callable, Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple, TypeVar

T = TypeVar("T")
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def side_script(name: str) -> str:
    """Path of a side script in this folder."""
    return os.path.join(HERE, name)


def pythonpath(*first: str) -> str:
    """`first` folders, then the current PYTHONPATH (kept: megatron may be installed there)."""
    current = os.environ.get("PYTHONPATH")
    return os.pathsep.join([*first, *([current] if current else [])])


_ONCE_LOCK = threading.Lock()
_ONCE: Dict[Any, Future[Any]] = {}


def _once(key: Any, fn: Callable[[], T]) -> T:
    """`fn()`, computed once per `key` and session even when threads ask at the same time."""
    with _ONCE_LOCK:
        future = _ONCE.get(key)
        owner = future is None
        if future is None:
            future = _ONCE[key] = Future()
    if owner:
        try:
            future.set_result(fn())
        except BaseException as e:
            future.set_exception(e)
    return future.result()


def probe(python: Optional[str], code: str, env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether `python -c code` succeeds (with `env` added to this process' environment)."""
    if not python:
        return False
    key = ("probe", python, code, tuple(sorted((env or {}).items())))
    return _once(key, lambda: _probe(python, code, dict(env or {})))


def _probe(python: str, code: str, env: Mapping[str, str]) -> bool:
    proc = subprocess.run([python, "-c", code], capture_output=True, env={**os.environ, **env})
    return proc.returncode == 0


#: what the interop tests probe the torchao and lm-resiliency interpreters for
TORCHAO_PROBE = "import torchao"
LMRES_PROBE = "import importlib.util as u; assert u.find_spec('lm_resiliency')"


def probe_all_in_background() -> None:
    """Starts every side interpreter's probe at once, in background threads (each start
    imports torch and a side library: seconds of one core each, which collection otherwise
    spends one after another); the tests' own calls then wait for the answers."""
    jobs: List[Callable[[], Any]] = [
        mcore_python,
        mcore013_python,
        mcore19,
        lambda: probe(os.environ.get("DIST_CKPT_TORCHAO_PYTHON"), TORCHAO_PROBE),
        lambda: probe(os.environ.get("DIST_CKPT_LMRES_PYTHON"), LMRES_PROBE),
    ]
    for job in jobs:
        threading.Thread(target=job, name="side-probe", daemon=True).start()


#: every module the interop tests ask a side interpreter about (see `importable`)
KNOWN_MODULES = (
    "megatron.core.dist_checkpointing",
    "megatron.core",
    "transformers",
    "dist_checkpointing",
    "dist_checkpointing.utils",
)

_IMPORT_EACH = """
import importlib, json, sys
ok = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
        ok.append(name)
    except Exception:
        pass
print("IMPORTABLE " + json.dumps(ok))
"""


def importable(python: Optional[str], *modules: str) -> bool:
    """Whether `python` imports every one of `modules`, this checkout first on its PYTHONPATH.

    One interpreter start per `python` answers for all of `KNOWN_MODULES` (each imported in
    turn; a failing one does not stop the others) and is cached for the session.
    """
    if not python:
        return False
    asked = tuple(dict.fromkeys(KNOWN_MODULES + modules))
    return set(modules) <= _once(("importable", python, asked), lambda: _importable(python, asked))


def _importable(python: str, modules: Tuple[str, ...]) -> FrozenSet[str]:
    env = {**os.environ, "PYTHONPATH": pythonpath(REPO)}
    proc = subprocess.run(
        [python, "-c", _IMPORT_EACH, *modules], capture_output=True, text=True, env=env
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("IMPORTABLE ")]
    return frozenset(json.loads(lines[-1][len("IMPORTABLE ") :])) if lines else frozenset()


def mcore_python() -> Optional[str]:
    """The interpreter with megatron-core 0.16 (see the module docstring), or None."""
    return _once("mcore_python", _mcore_python)


def _mcore_python() -> Optional[str]:
    candidate = os.environ.get("DIST_CKPT_MCORE_PYTHON")
    if not candidate and importlib.util.find_spec("megatron") is not None:
        candidate = sys.executable
    return candidate if importable(candidate, "megatron.core.dist_checkpointing") else None


def mcore013_python() -> Optional[str]:
    """`DIST_CKPT_MCORE013_PYTHON` if it imports megatron-core 0.13, else None."""
    return _once("mcore013_python", _mcore013_python)


def _mcore013_python() -> Optional[str]:
    candidate = os.environ.get("DIST_CKPT_MCORE013_PYTHON")
    code = "import megatron.core.package_info as p; assert p.__version__.startswith('0.13')"
    return candidate if probe(candidate, code) else None


def mcore19() -> Optional[Dict[str, str]]:
    """`{"python", "path"}` of megatron-core 0.19 (see the module docstring), or None."""
    return _once("mcore19", _mcore19)


def _mcore19() -> Optional[Dict[str, str]]:
    python = os.environ.get("DIST_CKPT_MCORE19_PYTHON")
    path = os.environ.get("DIST_CKPT_MCORE19_PATH")
    if not python or not path:
        return None
    code = "import megatron.core.dist_checkpointing.strategies.torch"
    return {"python": python, "path": path} if probe(python, code, {"PYTHONPATH": path}) else None


def run_side(
    python: str,
    args: Sequence[str],
    *,
    timeout: float,
    env: Optional[Mapping[str, str]] = None,
) -> str:
    """Runs `python args...` in its own process group, ends the group, returns its output.

    Args:
        python: the interpreter.
        args: script and arguments.
        timeout: seconds before the run counts as hung (then it is killed and the test fails).
        env: variables added to this process' environment.

    Returns:
        stdout and stderr together.

    Raises:
        AssertionError: the run failed (its last output in the message).
        subprocess.TimeoutExpired: it ran past `timeout`.
    """
    proc = subprocess.Popen(
        [python, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
        start_new_session=True,  # megatron leaves helper processes behind; end the whole group
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    return text


def read_json(path: str) -> Any:
    """The JSON document at `path`."""
    with open(path) as f:
        return json.load(f)
