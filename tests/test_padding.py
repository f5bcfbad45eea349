"""composer_replication.samples.padding against hand-computed rows, widths and masks."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from composer_replication.samples.padding import (
    pad_id_of,
    pad_lists,
    pad_rows,
    padded_width,
    stacked_pad,
)


def test_pad_id_is_the_pad_token_else_eos():
    assert pad_id_of(SimpleNamespace(pad_token_id=3, eos_token_id=9)) == 3
    assert pad_id_of(SimpleNamespace(pad_token_id=0, eos_token_id=9)) == 0  # 0 is an id
    assert pad_id_of(SimpleNamespace(pad_token_id=None, eos_token_id=9)) == 9
    with pytest.raises(ValueError, match="neither a pad nor an eos"):
        pad_id_of(SimpleNamespace(pad_token_id=None, eos_token_id=None))


def test_padded_width_is_the_longest_row_rounded_up():
    assert padded_width([3, 1, 2]) == 3
    assert padded_width([3, 1, 2], multiple=4) == 4
    assert padded_width([8], multiple=4) == 8
    assert padded_width([9], multiple=4) == 12
    assert padded_width([]) == 0
    with pytest.raises(ValueError, match="multiple=0"):
        padded_width([1], multiple=0)


def test_pad_lists_right_and_left():
    assert pad_lists([[5, 6, 7], [8]], 4, 0) == [[5, 6, 7, 0], [8, 0, 0, 0]]
    assert pad_lists([[5, 6, 7], [8]], 4, 9, left=True) == [[9, 5, 6, 7], [9, 9, 9, 8]]
    assert pad_lists([[], [1]], 1, 2) == [[2], [1]]
    with pytest.raises(ValueError, match="row of 3 entries does not fit width=2"):
        pad_lists([[1, 2, 3]], 2, 0)


def test_pad_rows_right_left_width_and_multiple():
    ids, mask = pad_rows([[5, 6, 7], [8]], 9)
    assert ids.tolist() == [[5, 6, 7], [8, 9, 9]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert ids.dtype == mask.dtype == torch.long
    ids, mask = pad_rows([[5, 6, 7], [8]], 9, left=True)
    assert ids.tolist() == [[5, 6, 7], [9, 9, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    ids, mask = pad_rows([[5, 6, 7], [8]], width=5)
    assert ids.tolist() == [[5, 6, 7, 0, 0], [8, 0, 0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]
    ids, mask = pad_rows([[5, 6, 7], [8]], 1, left=True, multiple=2)
    assert ids.tolist() == [[1, 5, 6, 7], [1, 1, 1, 8]]
    assert mask.tolist() == [[0, 1, 1, 1], [0, 0, 0, 1]]
    ids, mask = pad_rows([])
    assert ids.shape == mask.shape == (0, 0)
    with pytest.raises(ValueError, match="row of 3 entries does not fit width=2"):
        pad_rows([[1, 2, 3]], width=2)


def test_stacked_pad_holds_ids_and_mask_in_one_host_tensor():
    both = stacked_pad([[4], [5, 6]], 0, left=True)
    assert both.shape == (2, 2, 2) and both.device.type == "cpu"
    assert both.tolist() == [[[0, 4], [5, 6]], [[0, 1], [1, 1]]]


def test_importing_the_module_does_not_import_torch():
    code = "import sys, composer_replication.samples.padding; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
