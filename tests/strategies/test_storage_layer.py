"""The shared I/O layer (`dist_checkpointing.storage`): its fault seam, and local images on it."""

from __future__ import annotations

import errno
import multiprocessing as mp

import numpy as np
import pytest
import torch

from dist_checkpointing.local._image import decode_image, finish_image, start_image
from dist_checkpointing.local._image import write_image as write_local_image
from dist_checkpointing.local.basic_state_dict import BasicTensorAwareStateDict
from dist_checkpointing.storage import ALIGN, FileWriter, faults, read_file


def _image():
    state = BasicTensorAwareStateDict({"a": torch.arange(1000.0), "b": {"c": torch.ones(3, 5)}})
    return finish_image(start_image(state, ("s", 1)))


def test_local_images_are_written_and_read_through_the_io_layer_byte_for_byte(tmp_path):
    image = _image()
    path = str(tmp_path / "part")
    spy = faults.Fault("part", ops=("write", "read"))
    with faults.injected(spy):
        write_local_image(image, path)
        back = read_file(path)
    assert {c.op for c in spy.calls} == {"write", "read"}
    with open(path, "rb") as f:
        assert f.read() == image.buffer.numpy().tobytes()  # the format is the buffer, unchanged
    ckpt_id, state = decode_image(back, path)
    assert ckpt_id == ("s", 1) and torch.equal(state.pop_tensors()[0], torch.arange(1000.0))


def test_an_injected_write_error_fails_a_local_image_write_and_leaves_no_file(tmp_path):
    path = tmp_path / "part"
    err = OSError(errno.ENOSPC, "No space left on device")
    with faults.injected(faults.Fault("*/part", error=err)), pytest.raises(OSError, match="space"):
        write_local_image(_image(), str(path))
    assert not path.exists()


def test_faults_apply_only_to_matching_paths_and_operations(tmp_path):
    with faults.injected(faults.Fault("*.distcp", error=OSError(errno.EIO, "boom"))):
        w = FileWriter(tmp_path / "x.other", 4, direct=False)
        w.write(memoryview(b"abcd"), 0)  # another file: untouched
        w.finish()
        assert read_file(str(tmp_path / "x.other")).numpy().tobytes() == b"abcd"  # a read
        w = FileWriter(tmp_path / "y.distcp", 4, direct=False)
        with pytest.raises(OSError, match="boom"):
            w.write(memoryview(b"abcd"), 0)
        w.abort(remove=True)
    assert not (tmp_path / "y.distcp").exists()


def _write_three_blocks(path: str) -> None:
    faults.inject(faults.Fault("*.distcp", die_after_bytes=ALIGN + 100))
    data = np.full(3 * ALIGN, 7, dtype=np.uint8)
    w = FileWriter(path, data.size, direct=False)
    for start in range(0, data.size, ALIGN):
        w.write(memoryview(data[start : start + ALIGN]), start)  # type: ignore[arg-type]
    w.finish()


def test_an_injected_death_kills_the_writer_after_exactly_n_bytes(tmp_path):
    path = str(tmp_path / "d.distcp")
    proc = mp.get_context("fork").Process(target=_write_three_blocks, args=(path,))
    proc.start()
    proc.join(60)
    assert proc.exitcode == -9
    with open(path, "rb") as f:
        written = f.read()
    assert written[: ALIGN + 100] == b"\x07" * (ALIGN + 100)
    assert set(written[ALIGN + 100 :]) <= {0}  # the rest never reached the file
