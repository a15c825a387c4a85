"""erniekit/utils/malloc.py: freed blocks stay in the heap for reuse, and ERNIEKIT_MALLOC_MMAP_MB
maps blocks from a size on their own (returned to the OS on free) for a lower peak."""

import subprocess
import sys
import textwrap

import pytest

from erniekit.errors import ErniekitError
from erniekit.utils.malloc import MMAP_ENV, mallinfo, mmap_threshold

pytestmark = pytest.mark.skipif(mallinfo() is None, reason="glibc >= 2.33 (mallopt, mallinfo2)")


def test_the_threshold_reads_whole_mib_and_refuses_the_rest_in_one_line():
    assert mmap_threshold({}) == 1 << 30 == mmap_threshold({MMAP_ENV: " "})
    assert mmap_threshold({MMAP_ENV: "64"}) == 64 << 20
    assert mmap_threshold({MMAP_ENV: "4096"}) == 1 << 30  # nothing above the kept heap's own cap
    for bad in ("0", "-3", "1.5", "lots"):
        with pytest.raises(ErniekitError, match=f"{MMAP_ENV}='{bad}': give a whole number of MiB") as e:
            mmap_threshold({MMAP_ENV: bad})
        assert "\n" not in str(e.value)


_PROBE = textwrap.dedent(
    """
    import numpy as np
    from erniekit.utils.malloc import keep_freed_memory, mallinfo

    assert keep_freed_memory()
    before = mallinfo().hblkhd
    block = np.ones(24 << 18, np.float32)  # 24 MiB through malloc
    print(mallinfo().hblkhd - before)
    """
)


@pytest.mark.parametrize("mb, mapped", [(None, False), ("16", True), ("32", False)])
def test_blocks_from_the_threshold_are_mapped_on_their_own(mb, mapped):
    env = {"PATH": "/usr/bin:/bin"} | ({MMAP_ENV: mb} if mb else {})
    r = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (int(r.stdout) >= 24 << 20) is mapped, r.stdout


_TRIM_PROBE = textwrap.dedent(
    """
    import numpy as np
    from erniekit.utils.malloc import keep_freed_memory, release_freed_heap

    def resident():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    assert keep_freed_memory()
    block = np.ones(64 << 18, np.float32)  # 64 MiB in the kept heap, its pages touched
    del block
    kept = resident()
    assert release_freed_heap()
    print(kept - resident())
    """
)


def test_release_freed_heap_gives_the_kept_blocks_pages_back():
    """What the start-up freed (a float32 model cast to a bf16 base, parts a rank does not hold) stays
    resident under keep_freed_memory until train/run.py releases it once before the first step."""
    r = subprocess.run(
        [sys.executable, "-c", _TRIM_PROBE], env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout) >= 48 << 20, r.stdout  # most of the 64 MiB back to the OS
