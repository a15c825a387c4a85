"""Seeded, resumable micro-batch order: the position in the data is one integer."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from erniekit.data.encode import pad_batch


class MicroBatches:
    """Micro-batch number `i` is a pure function of (seed, i): epoch e = i // per_epoch uses
    permutation rng(seed + e), so resuming at `consumed` reproduces the rest of the run."""

    def __init__(
        self,
        rows: Sequence[dict[str, np.ndarray]],
        batch_size: int,
        seed: int,
        pad_id: int,
        shuffle: bool = True,
        collate_fn=None,
    ):
        self.rows, self.batch_size, self.seed, self.pad_id, self.shuffle = rows, batch_size, seed, pad_id, shuffle
        self.collate_fn = collate_fn or collate
        self.per_epoch = max(1, -(-len(rows) // batch_size))
        self._perm_epoch, self._perm = -1, None

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            n = len(self.rows)
            self._perm = np.random.default_rng(self.seed + epoch).permutation(n) if self.shuffle else np.arange(n)
            self._perm_epoch = epoch
        return self._perm

    def get(self, i: int) -> dict[str, np.ndarray]:
        epoch, k = divmod(i, self.per_epoch)
        idx = self._order(epoch)[k * self.batch_size : (k + 1) * self.batch_size]
        return self.collate_fn([self.rows[j] for j in idx], self.pad_id)


def collate(rows: Sequence[dict[str, np.ndarray]], pad_id: int) -> dict[str, np.ndarray]:
    """Rows of equal length (packed) are stacked; others are right-padded."""
    if len({len(r["input_ids"]) for r in rows}) == 1 and "segment_ids" in rows[0]:
        return {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    batch = pad_batch([(r["input_ids"], r["labels"]) for r in rows], pad_id=pad_id)
    if "token_type_ids" in rows[0]:  # modality ids (modality-isolated MoE routing): padding counts as text
        types = np.zeros(batch["input_ids"].shape, np.int64)
        for i, r in enumerate(rows):
            types[i, : len(r["token_type_ids"])] = r["token_type_ids"]
        batch["token_type_ids"] = types
    return batch
