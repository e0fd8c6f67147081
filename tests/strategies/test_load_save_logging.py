"""INFO lines for save and load (bytes, seconds, GB/s, files); byte counts of resharded reads."""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
import textwrap
from typing import List

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor, _progress
from dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

ROWS, COLS = 8, 1024  # float32: 4096 bytes per row, 32 KiB in all
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _save_whole(path) -> torch.Tensor:
    full = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    dc.save({"w": ShardedTensor.from_rank_offsets("w", full)}, path)
    return full


def _load_info(text: str) -> re.Match:
    m = re.search(
        r"torch_dist load \S+: [\d.]+ GB \((\d+) bytes\) read by (\d+) rank\(s\) from (\d+) "
        r"file\(s\) per rank at most in "
        r"([\d.]+) s \(slowest rank\), ([\d.]+) GB/s",
        text,
    )
    assert m, text
    return m


def test_save_and_load_log_bytes_seconds_rate_and_files_at_info(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="dist_checkpointing")
    full = _save_whole(tmp_path / "c")
    saved = re.search(
        r"torch_dist save \S+: 1 items, [\d.]+ GB \((\d+) bytes\) in 1 file\(s\) from 1 "
        r"rank\(s\) in [\d.]+ s \(until the slowest rank finished\), [\d.]+ GB/s",
        caplog.text,
    )
    assert saved, caplog.text
    assert ROWS * COLS * 4 <= int(saved.group(1)) < ROWS * COLS * 4 + 4096  # data + zip records
    caplog.clear()
    out = dc.load(
        {"w": ShardedTensor.from_rank_offsets("w", torch.empty(ROWS, COLS))}, tmp_path / "c"
    )
    assert torch.equal(out["w"], full)
    m = _load_info(caplog.text)
    assert (m.group(2), m.group(3)) == ("1", "1")


def test_resharded_load_counts_only_the_rows_it_read(tmp_path, caplog):
    _save_whole(tmp_path / "c")
    caplog.set_level(logging.DEBUG, logger="dist_checkpointing")
    half = ShardedTensor.from_rank_offsets("w", torch.empty(ROWS // 2, COLS), (0, 1, 2))
    strategy = TorchDistLoadShardedStrategy(verify_checksums=False)  # no widening to blocks
    dc.load({"w": half}, tmp_path / "c", sharded_strategy=strategy, validate_access_integrity=False)
    assert int(_load_info(caplog.text).group(1)) == (ROWS // 2) * COLS * 4  # 4 of 8 rows
    assert "rank 0 loaded" in caplog.text  # the per-rank DEBUG line


def load_rows_capturing_info(ckpt: str) -> List[str]:
    """In a 2-rank world: each rank loads its half of the rows; returns the INFO lines."""
    records: List[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    log = logging.getLogger("dist_checkpointing")
    handler, before = Keep(level=logging.INFO), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        r = dist.get_rank()
        want = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(ROWS // 2, COLS), (0, r, 2))}
        strategy = TorchDistLoadShardedStrategy(verify_checksums=False)
        dc.load(want, ckpt, sharded_strategy=strategy)
    finally:
        log.removeHandler(handler)
        log.setLevel(before)
    return [m for m in records if m.startswith("torch_dist load")]


@pytest.mark.timeout(180)
def test_two_rank_resharded_load_logs_once_with_the_bytes_actually_read(world_factory, tmp_path):
    _save_whole(tmp_path / "c")  # one stored chunk of 8 rows; each rank reads 4 of them
    lines = world_factory(2).run_ok(load_rows_capturing_info, str(tmp_path / "c"))
    assert lines[1] == [] and len(lines[0]) == 1, lines  # rank 0 only
    m = _load_info(lines[0][0])
    assert m.group(2) == "2" and m.group(3) == "1"
    assert int(m.group(1)) == ROWS * COLS * 4  # each rank read its 4 rows: not twice that


@pytest.mark.timeout(300)
def test_persistent_async_writer_logs_at_the_callers_level(tmp_path):
    script = tmp_path / "save.py"
    script.write_text(
        textwrap.dedent(
            """\
            import logging, sys
            import torch
            import dist_checkpointing as dc
            from dist_checkpointing import ShardedTensor
            from dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            if __name__ == "__main__":
                logging.basicConfig(level=logging.DEBUG)
                q = AsyncCallsQueue(persistent=True)
                sd = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}
                q.schedule_async_request(dc.save(sd, sys.argv[1], async_sharded_save=True))
                q.close()
            """
        )
    )
    env = dict(os.environ, PYTHONPATH=_ROOT, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "c")],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    assert "async writer dist_checkpointing.async_save.callers: async writer (pid" in out.stderr


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_sync_save_and_load_draw_progress_bars_on_a_terminal(tmp_path, monkeypatch):
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    monkeypatch.setattr(_progress, "SHOW_AFTER_S", 0.0)
    _save_whole(tmp_path / "c")
    dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(ROWS, COLS))}, tmp_path / "c")
    assert "save c" in term.getvalue() and "load c" in term.getvalue()
