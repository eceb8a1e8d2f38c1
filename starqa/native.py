"""starqa's compiled CPU attention kernel (starqa/_attend.c, built by `pip install` where a
C compiler is found), called through ctypes. Without it, `available()` is False and
starqa.attention falls back to torch's kernels."""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
from pathlib import Path

import torch


@functools.cache
def _kernel():
    folder = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = folder / f"_attend{suffix}"
        if path.exists():
            try:
                function = ctypes.CDLL(str(path)).starqa_attend
            except (OSError, AttributeError):  # built for another platform, or damaged
                return None
            i64, ptr = ctypes.c_int64, ctypes.c_void_p
            function.restype = ctypes.c_int
            function.argtypes = [ctypes.c_int, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64,
                                 i64, i64, i64, ctypes.c_float, ctypes.c_int]
            return function
    return None


def available() -> bool:
    """Whether the compiled kernel is here."""
    return _kernel() is not None


def supports(key: torch.Tensor, value: torch.Tensor | None = None) -> bool:
    """Whether `attend` takes keys (and values) like these, [H, N, D]: CPU, bf16 or fp32,
    rows contiguous, D at most 256; values of the keys' shape and dtype."""
    def fits(x: torch.Tensor) -> bool:
        return (x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32)
                and x.dim() == 3 and x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]
                and x.shape[-1] <= 256)

    return (fits(key) and (value is None or fits(value) and value.shape == key.shape
                           and value.dtype == key.dtype) and available())


def attend(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
           own: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel behind starqa.attention.partial_rows (see there): q [H, R, D], key/value
    [H, N, D] as `supports` says (heads may lie any distance apart). Returns out [H, R, D]
    and lse [H, R], both fp32."""
    heads, rows, dim = q.shape
    q = q.to(torch.float32).contiguous()
    out = q.new_empty(heads, rows, dim)
    lse = q.new_empty(heads, rows)
    code = _kernel()(int(key.dtype == torch.bfloat16), q.data_ptr(), key.data_ptr(),
                     value.data_ptr(), out.data_ptr(), lse.data_ptr(), heads, rows, dim,
                     key.stride(0), value.stride(0), key.shape[1], own, scale,
                     torch.get_num_threads())
    if code:
        raise (MemoryError() if code == 2 else ValueError(
            f"attention kernel: impossible shapes q {tuple(q.shape)}, keys "
            f"{tuple(key.shape)}, own {own}"))
    return out, lse
