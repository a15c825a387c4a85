"""What the CPU training kernels keep in memory, without importing Paddle: the planner
(erniekit/distributed/planner.py) counts the same bytes that nn/fused_attention.py and
nn/linear_cross_entropy.py hold."""

from __future__ import annotations

# ---- the attention kernel (nn/fused_attention.py) ----------------------------------------------
# Above this many bytes of probabilities per call the kernel's forward keeps each row's softmax max
# and reciprocal sum instead, and its backward computes the scores again (same bits). Measured by
# tools/bench_attention_recompute.py (docs/performance.md, twelfth round), recomputed / saved time:
# 0.88-0.96x at 256-512 tokens of 64-wide heads, 1.03-1.08x with 128-wide ones, 1.09-1.21x at
# 1024-2048 tokens, 0.91x at 4096; at the embedded default's 32 tokens (2 MiB) 1.15-1.22x, so small
# calls keep the probabilities.
KEEP_PROBS_BYTES = 4 << 20


def keeps_probs(batch: int, heads: int, q_len: int, k_len: int) -> bool:
    """Whether a training forward of the kernel saves its [B, H, Sq, Sk] float32 probabilities
    (else 8 bytes a row)."""
    return batch * heads * q_len * k_len * 4 <= KEEP_PROBS_BYTES


def kernel_head_dim(head_dim: int) -> bool:
    """Whether the kernel takes heads this wide (nn/fused_attention.usable: a multiple of 16)."""
    return head_dim % 16 == 0


# ---- the LM head's loss in chunks (nn/linear_cross_entropy.py) -----------------------------------
CHUNK_BYTES = 128 << 20  # one chunk's float32 logits at most this, ...
MIN_CHUNK_ROWS = 1024  # ... but at least this many rows: the weight's gradient is read and written once a chunk


def chunk_rows(vocab: int, rows: int) -> int:
    """Rows per chunk for a vocabulary of `vocab` (all `rows` when they fit in one)."""
    per = max(MIN_CHUNK_ROWS, CHUNK_BYTES // (4 * max(vocab, 1)))
    return min(rows, per)
