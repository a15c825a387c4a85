"""Importing paddle the way every erniekit command does (the CLI, and what it calls)."""

from __future__ import annotations

import contextlib
import io
import os
import sys
import warnings


def contiguous_cpu_kernels(env=os.environ) -> None:
    """FLAGS_use_stride_kernel=0 unless the user set it: a transpose or expand then writes a
    contiguous tensor with Paddle's own kernel instead of a strided view that the next op copies
    element by element. Measured on the attention of the embedded default's model (2 threads):
    q's transpose + reshape 2.2 ms -> 0.07 ms, k's 0.9 -> 0.03 ms; values identical. Read when
    paddle is imported."""
    env.setdefault("FLAGS_use_stride_kernel", "0")


def import_paddle() -> None:
    """Import paddle using every CPU core, its vector units and reusing freed memory, without its
    start-up noise.

    Paddle's CPU kernels default to one OpenMP thread (about 2x slower GEMMs on 2 cores), so
    OMP_NUM_THREADS defaults to the core count; on AMD CPUs its MKL needs MKL_DEBUG_CPU_TYPE to use
    AVX2 / AVX-512 (utils/mkl.py); transposes and expands materialize (contiguous_cpu_kernels). Paddle then warns about the thread setting and about ccache on
    every import, which we drop. Any other output passes through.
    """
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    from erniekit.utils.malloc import keep_freed_memory
    from erniekit.utils.mkl import use_mkl_vector_kernels

    use_mkl_vector_kernels()
    keep_freed_memory()
    contiguous_cpu_kernels()
    captured = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(captured):
            warnings.filterwarnings("ignore", message="No ccache found")
            import paddle  # noqa: F401
    finally:
        noise = ("WARNING: OMP_NUM_THREADS set to", "PLEASE USE OMP_NUM_THREADS WISELY")
        kept = [line for line in captured.getvalue().splitlines(True) if not line.startswith(noise)]
        sys.stderr.write("".join(kept))
