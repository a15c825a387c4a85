"""Whether a serving engine keeps packed copies of the weights (`--packed-weights auto|on|off`).

The packed panels (erniekit/nn/small_gemm.py) make 8-64-row decode steps faster for a second copy of
the projections: ~1.5x a step on a CPU with AVX-512 (docs/performance.md, the eighth round); with
AVX2 only, a product at 8-16 rows 1.5-2x and the benchmark's ratio to torch 1.1-1.4x (the sixteenth
round). At 1 row they gain nothing there. `auto` takes that trade where the copy is small against
the memory the machine has free, on the CPUs it was measured on (x86 with AVX2 or AVX-512: the
tiles assume 16 vector registers of 32 bytes or more), and says so in one line.
"""

from __future__ import annotations

from erniekit.errors import ErniekitError
from erniekit.nn import small_gemm
from erniekit.utils.mkl import has_avx512, read_cpuinfo

MODES = ("auto", "on", "off")
AUTO_SHARE = 0.25  # auto packs when the copy takes at most this share of the memory available


def available_memory() -> int | None:
    """Bytes of memory available to new allocations (Linux MemAvailable; None where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def packing_choice(
    model, mode: str, available: int | None = None, cpu_flags: set[str] | None = None
) -> tuple[bool, str]:
    """(pack or not, the reason in words) for `mode`; `available` and `cpu_flags` override the
    measured memory and this CPU's feature flags."""
    if mode not in MODES:
        raise ErniekitError(f"--packed-weights {mode}: choose one of {', '.join(MODES)}")
    if mode == "off":
        return False, "packed weights off (--packed-weights off)"
    need = small_gemm.packable_bytes(model)
    mib = f"{need / 2**20:.1f} MiB"
    if need == 0:
        return False, "packed weights: none to pack, no float32 CPU projection of 256 KiB or more"
    if mode == "on":
        return True, f"packed weights on (+{mib}, --packed-weights on)"
    flags = read_cpuinfo()[1] if cpu_flags is None else cpu_flags
    if "avx2" not in flags and not has_avx512(flags):
        return False, (
            f"packed weights off: measured only on x86 CPUs with AVX2 or AVX-512, which this one is not "
            f"(+{mib} with --packed-weights on)"
        )
    available = available_memory() if available is None else available
    if available is None:
        return False, f"packed weights off: the memory available is unknown here (+{mib} with --packed-weights on)"
    free = f"{available / 2**20:.0f} MiB available"
    if need <= AUTO_SHARE * available:
        return True, f"packed weights on (+{mib} for faster batched decode, {free}; --packed-weights off saves it)"
    return (
        False,
        f"packed weights off: the copy ({mib}) is over a quarter of the {free} (--packed-weights on forces it)",
    )
