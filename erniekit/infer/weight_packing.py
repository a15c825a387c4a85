"""Whether a serving engine keeps packed copies of the weights (`--packed-weights auto|on|off`).

The packed panels (erniekit/nn/small_gemm.py) make 8-64-row decode steps ~1.5x faster on a CPU with
AVX-512 (docs/performance.md, the eighth round) and ~2x on one with AVX2 only (the sixteenth round)
for a second copy of the projections. `auto` takes that trade where the copy is small against the
memory the machine has free, and says so in one line.
"""

from __future__ import annotations

from erniekit.errors import ErniekitError
from erniekit.nn import small_gemm

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


def packing_choice(model, mode: str, available: int | None = None) -> tuple[bool, str]:
    """(pack or not, the reason in words) for `mode`; `available` overrides the measured memory."""
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
