"""Cross-cluster sync maths: payload sizes, compression with error feedback, outer optimizers, OuterSync."""

from __future__ import annotations

import numpy as np
import pytest

from erniekit.distributed.cross_cluster.compress import ROW, FlatCompressor, payload_nbytes
from erniekit.errors import ErniekitError


@pytest.mark.parametrize("kind", ["none", "int8", "topk"])
@pytest.mark.parametrize("n,row,ratio", [(1, ROW, 0.01), (1000, 64, 0.1), (4096, 1024, 0.01), (70001, 1024, 0.3)])
def test_payload_nbytes_is_the_encoded_length(kind, n, row, ratio):
    comp = FlatCompressor(kind, n, ratio, row)
    payload = comp.encode(np.random.default_rng(n).standard_normal(n).astype(np.float32))
    assert len(payload) == payload_nbytes(kind, n, ratio, row)


def test_payload_nbytes_formula():
    # 13-byte header; int8: 1 byte per element + a float32 scale per row; topk: k float32 + k uint16 per row.
    assert payload_nbytes("none", 3000, 0.1, 1024) == 13 + 4 * 3000
    assert payload_nbytes("int8", 3000, 0.1, 1024) == 13 + 3000 + 4 * 3
    assert payload_nbytes("topk", 3000, 0.1, 1024) == 13 + 3 * 103 * (4 + 2)
    assert payload_nbytes("topk", 10, 0.5, 1 << 17) == 13 + 1 * (1 << 16) * (4 + 4)  # int32 indices past 65536
    with pytest.raises(ErniekitError, match="use one of"):
        payload_nbytes("fp8", 10, 0.1)
