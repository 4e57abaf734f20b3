"""Every private torch name the numerical check relies on, checked once at import.

- `torch._amp_foreach_non_finite_check_and_unscale_`, the op `torch.amp.GradScaler` runs on
  every mixed-precision step to find an inf or NaN gradient. Given a list of tensors, it sets
  a flag tensor when any element is not finite, in one call: one fused kernel over the whole
  list on a GPU, one C++ loop on the CPU. The public ways cost a call per gradient tensor
  (a `sum` or an `isfinite` each: 0.24 ms for the recipes' 28 gradients on one CPU thread,
  against 0.09 ms for this op). With a scale of exactly 1 it writes every element back
  unchanged (its kernels keep the value as it is when the scale is 1), so no gradient bit
  changes. It is used by numeric/screen.py, which falls back to one `sum` per tensor where
  this op refuses a tensor (a layout it does not take).

A torch without it fails here, at import, with TorchCompatError naming the torch version and
the feature (resilient/_torch_check.py).

Checked on torch 2.11.0, 2.12.0, 2.13.0, 2.14.1, 2.15.0 (the tested range): the op is there
on each, and tests/test_numeric.py's screen tests ran on the releases
docs/operating.md#torch-releases lists.
"""

from __future__ import annotations

import torch

from resilient._torch_check import require_attrs

__all__ = ["flag_nonfinite"]

require_attrs(
    torch,
    ("_amp_foreach_non_finite_check_and_unscale_",),
    feature="the numerical check's gradient screen (numeric/screen.py)",
)

_ONES: dict[torch.device, torch.Tensor] = {}


def flag_nonfinite(tensors: list[torch.Tensor], flag: torch.Tensor) -> None:
    """Set `flag` (one float32 element, on the tensors' device; all of `tensors` on that
    device and of one dtype) to 1 when any element of `tensors` is NaN or inf; leave it as
    it is otherwise. The tensors' values do not change. Raises RuntimeError where torch
    refuses one of them."""
    one = _ONES.get(flag.device)
    if one is None:
        one = _ONES[flag.device] = torch.ones(1, device=flag.device)
    torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, one)
