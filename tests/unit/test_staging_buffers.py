"""Huge-page staging buffers for direct reads (`storage.buffers.staging`)."""

from __future__ import annotations

import pytest

from dist_checkpointing.storage import buffers


@pytest.fixture
def thp_setting(tmp_path, monkeypatch):
    """Points the kernel's huge-page setting at a file the test writes."""
    path = tmp_path / "enabled"
    monkeypatch.setattr(buffers, "THP_ENABLED", str(path))
    buffers.huge_pages.cache_clear()
    yield path
    buffers.huge_pages.cache_clear()


@pytest.mark.parametrize(
    "setting, usable",
    [
        ("always [madvise] never\n", True),
        ("[always] madvise never\n", True),
        ("always madvise [never]\n", False),
        (None, False),  # no such file: not Linux, or no THP support
    ],
)
def test_huge_pages_follow_the_kernels_setting(thp_setting, setting, usable):
    if setting is not None:
        thp_setting.write_text(setting)
    assert buffers.huge_pages() is usable
    if not usable:
        assert buffers.staging(1 << 20) is None


def test_a_staging_buffer_is_huge_page_aligned_writable_and_of_the_size_asked():
    if not buffers.huge_pages():
        pytest.skip("this kernel gives no transparent huge pages")
    for nbytes in (4096, (2 << 20) + 4096, 17 << 20):
        buf = buffers.staging(nbytes)
        assert buf is not None and buf.size == nbytes
        assert buf.ctypes.data % buffers.HUGE == 0
        buf[:] = 7
        buf[-1] = 9
        assert int(buf[0]) == 7 and int(buf[-1]) == 9
