"""The two number systems every oracle is written once against.

An oracle form is plain array code (``+ - * /``, ``@``, slicing, ``.mT``,
``.swapaxes``) plus the few functions below, taken from a backend ``xp``:

- ``Float64``: torch float64 tensors on the inputs' device (CPU or CUDA), so
  long sequences can run on a GPU. ``Float64(device, dtype)`` with a lower
  torch dtype evaluates the same code in that dtype: not an oracle, but the
  naive same-precision baselines the reports compare kernels with.
- ``MPMath``: numpy arrays of ``mpmath.mpf`` (dtype object) at ``dps`` decimal
  digits. Inputs are converted exactly (every float64 is an mpf), every exp,
  log and division is evaluated at the working precision, and the result is
  rounded once, to nearest, into a float64 tensor.

The same source therefore serves as the fast reference and as its certificate.

``xp.recompute(step, *arrays)`` is ``step(*arrays)``; under torch autograd it
keeps only the step's inputs and recomputes its intermediates in the backward
(activation checkpointing), so a form whose steps build large blocks (aft's
[T, chunk, D] logits) can be differentiated at lengths whose intermediates
would not fit. The values are the same to the bit either way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mpmath
import numpy as np
import torch
import torch.utils.checkpoint

Array = Any  # a float64 torch.Tensor or a numpy object array of mpf


class Float64:
    """torch tensors on the device of the inputs, in float64 unless ``dtype`` says otherwise."""

    def __init__(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float64) -> None:
        self.device = torch.device(device)
        self.dtype = dtype
        self.name = str(dtype).replace("torch.", "")

    # conversion -------------------------------------------------------
    def asarray(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device=self.device, dtype=self.dtype)

    def to_tensor(self, array: torch.Tensor) -> torch.Tensor:
        return array

    def scalar(self, value: float) -> float:
        return float(value)

    # construction -----------------------------------------------------
    def zeros(self, shape: Sequence[int]) -> torch.Tensor:
        return torch.zeros(tuple(shape), dtype=self.dtype, device=self.device)

    def full(self, shape: Sequence[int], value: float) -> torch.Tensor:
        return torch.full(tuple(shape), float(value), dtype=self.dtype, device=self.device)

    def eye(self, n: int) -> torch.Tensor:
        return torch.eye(n, dtype=self.dtype, device=self.device)

    def arange(self, n: int) -> torch.Tensor:
        return torch.arange(n, dtype=self.dtype, device=self.device)

    def tril_mask(self, n: int, m: int | None = None, diagonal: int = 0) -> torch.Tensor:
        m = n if m is None else m
        return torch.ones(n, m, dtype=torch.bool, device=self.device).tril(diagonal)

    # elementwise ------------------------------------------------------
    def exp(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x)

    def log(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)

    def maximum(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.maximum(torch.as_tensor(a, device=self.device), torch.as_tensor(b, device=self.device))

    def where(self, cond: torch.Tensor, a: Array, b: Array) -> torch.Tensor:
        a = torch.as_tensor(a, dtype=self.dtype, device=self.device)
        b = torch.as_tensor(b, dtype=self.dtype, device=self.device)
        return torch.where(cond, a, b)

    # reductions and shape ---------------------------------------------
    def sum(self, x: torch.Tensor, axis: int, keepdims: bool = False) -> torch.Tensor:
        return x.sum(dim=axis, keepdim=keepdims)

    def amax(self, x: torch.Tensor, axis: int, keepdims: bool = False) -> torch.Tensor:
        return x.amax(dim=axis, keepdim=keepdims)

    def cumsum(self, x: torch.Tensor, axis: int) -> torch.Tensor:
        return x.cumsum(dim=axis)

    def stack(self, arrays: Sequence[torch.Tensor], axis: int) -> torch.Tensor:
        return torch.stack(list(arrays), dim=axis)

    def concat(self, arrays: Sequence[torch.Tensor], axis: int) -> torch.Tensor:
        return torch.cat(list(arrays), dim=axis)

    def copy(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    # autograd ---------------------------------------------------------
    def recompute(self, step: Callable[..., Any], *arrays: torch.Tensor) -> Any:
        if torch.is_grad_enabled() and any(a.requires_grad for a in arrays if isinstance(a, torch.Tensor)):
            return torch.utils.checkpoint.checkpoint(step, *arrays, use_reentrant=False)
        return step(*arrays)


class MPMath:
    """numpy object arrays of mpmath.mpf at ``dps`` decimal digits.

    Use as a context manager: inside it, mpmath works at ``dps`` digits.
    """

    name = "mpmath"

    def __init__(self, dps: int = 50, device: torch.device | str = "cpu") -> None:
        self.dps = int(dps)
        self.device = torch.device(device)
        self._workdps = mpmath.workdps(self.dps)
        self._exp = np.frompyfunc(mpmath.exp, 1, 1)
        self._log = np.frompyfunc(mpmath.log, 1, 1)
        self._max = np.frompyfunc(max, 2, 1)

    def __enter__(self) -> MPMath:
        self._workdps.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._workdps.__exit__(*exc)

    # conversion -------------------------------------------------------
    def asarray(self, tensor: torch.Tensor) -> np.ndarray:
        values = tensor.detach().to(device="cpu", dtype=torch.float64).numpy()
        return np.frompyfunc(mpmath.mpf, 1, 1)(values).astype(object).reshape(values.shape)

    def to_tensor(self, array: np.ndarray) -> torch.Tensor:
        rounded = np.frompyfunc(float, 1, 1)(np.asarray(array, dtype=object)).astype(np.float64)
        return torch.from_numpy(np.ascontiguousarray(rounded)).to(self.device)

    def scalar(self, value: float) -> mpmath.mpf:
        return mpmath.mpf(value)

    # construction -----------------------------------------------------
    def full(self, shape: Sequence[int], value: float) -> np.ndarray:
        return np.full(tuple(shape), mpmath.mpf(value), dtype=object)

    def zeros(self, shape: Sequence[int]) -> np.ndarray:
        return self.full(shape, 0)

    def eye(self, n: int) -> np.ndarray:
        out = self.zeros((n, n))
        for i in range(n):
            out[i, i] = mpmath.mpf(1)
        return out

    def arange(self, n: int) -> np.ndarray:
        return np.array([mpmath.mpf(i) for i in range(n)], dtype=object)

    def tril_mask(self, n: int, m: int | None = None, diagonal: int = 0) -> np.ndarray:
        return np.tri(n, n if m is None else m, diagonal, dtype=bool)

    # elementwise ------------------------------------------------------
    def exp(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(self._exp(x), dtype=object)

    def log(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(self._log(x), dtype=object)

    def maximum(self, a: Array, b: Array) -> np.ndarray:
        return np.asarray(self._max(a, b), dtype=object)

    def where(self, cond: np.ndarray, a: Array, b: Array) -> np.ndarray:
        if not isinstance(a, np.ndarray):
            a = mpmath.mpf(a)
        if not isinstance(b, np.ndarray):
            b = mpmath.mpf(b)
        return np.where(cond, a, b).astype(object)

    # reductions and shape ---------------------------------------------
    def sum(self, x: np.ndarray, axis: int, keepdims: bool = False) -> np.ndarray:
        return np.sum(x, axis=axis, keepdims=keepdims)

    def amax(self, x: np.ndarray, axis: int, keepdims: bool = False) -> np.ndarray:
        return np.max(x, axis=axis, keepdims=keepdims)

    def cumsum(self, x: np.ndarray, axis: int) -> np.ndarray:
        return np.cumsum(x, axis=axis, dtype=object)

    def stack(self, arrays: Sequence[np.ndarray], axis: int) -> np.ndarray:
        return np.stack(list(arrays), axis=axis)

    def concat(self, arrays: Sequence[np.ndarray], axis: int) -> np.ndarray:
        return np.concatenate(list(arrays), axis=axis)

    def copy(self, x: np.ndarray) -> np.ndarray:
        return x.copy()

    def recompute(self, step: Callable[..., Any], *arrays: np.ndarray) -> Any:
        return step(*arrays)


Backend = Float64 | MPMath
