"""The structured-outputs logit mask: the compiled CPU kernel against its torch twin."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from zeroserve.kernels import cpu_native
from zeroserve.kernels.token_bitmask import apply_token_bitmask_, apply_token_bitmask_torch_, unpack_bitmask


def _mask(allowed: np.ndarray) -> torch.Tensor:
    k, v = allowed.shape
    words = np.zeros((k, (v + 31) // 32), np.uint32)
    for r, t in zip(*np.nonzero(allowed)):
        words[r, t // 32] |= np.uint32(1 << (t % 32))
    return torch.from_numpy(words.view(np.int32))


@pytest.mark.parametrize("vocab", [1, 31, 32, 70, 4099])
def test_compiled_mask_equals_the_twin(vocab):
    if cpu_native.ops_lib() is None:
        pytest.skip(f"no compiled kernels: {cpu_native.ops_unavailable_reason()}")
    rng = np.random.default_rng(vocab)
    x = torch.from_numpy(rng.standard_normal((7, vocab)).astype(np.float32))
    x[2, : max(1, vocab // 2)] = float("-inf")  # banned tokens already -inf
    rows = torch.tensor([5, 0, 2, 6])
    allowed = rng.random((4, vocab)) < 0.4
    allowed[3] = False  # a row the grammar leaves nothing in
    allowed[2] = False
    allowed[2, 0] = True  # only a banned token allowed: dead
    bm = _mask(allowed)
    a, b = x.clone(), x.clone()
    dead_c, dead_t = apply_token_bitmask_(a, rows, bm), apply_token_bitmask_torch_(b, rows, bm)
    assert torch.equal(a, b) and torch.equal(dead_c, dead_t)
    assert dead_c.tolist()[2:] == [True, True]
    assert torch.equal(unpack_bitmask(bm, vocab), torch.from_numpy(allowed))
    untouched = [1, 3, 4]
    assert torch.equal(a[untouched], x[untouched])


def test_rows_outside_the_logits_are_refused():
    if cpu_native.ops_lib() is None:
        pytest.skip("no compiled kernels")
    with pytest.raises(IndexError):
        apply_token_bitmask_(torch.zeros(2, 40), torch.tensor([2]), torch.zeros(1, 2, dtype=torch.int32))
