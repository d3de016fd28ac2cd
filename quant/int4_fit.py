"""Error-minimising choice of INT4 group parameters (scale and min) instead of plain min/max.

:func:`llmd.quant.int4.quantize_int4` maps each group's ``[min, max]`` onto the 16 levels. That
wastes levels on outliers and ignores where the mass of the group is; for coarse groups (64, 128)
it costs a lot of quality on small models. :func:`fit_int4_groups` instead picks, per group, the
``scale`` and ``min`` (``w ~= scale * q + min``, ``q`` in 0..15) that minimise the (optionally
importance-weighted) squared error, in two stages:

1. **Clipping search** (AWQ / llama.cpp ``make_qkx2_quants`` style). A small grid of candidate
   ranges obtained by shrinking the group's range from either end; for each, ``q`` is the nearest
   level, then ``scale`` and ``min`` are re-solved by weighted least squares for that ``q``. The
   candidate with the lowest error wins, per group. The unshrunk range is always a candidate, so
   the result is never worse than min/max (and a group that min/max represents exactly, e.g. a
   Q4_1 block requantised at the same group size, stays exact).
2. **Alternating refinement** (Lloyd-style). Repeat: assign each weight its nearest level for the
   current ``(scale, min)`` (optimal for fixed parameters), then least-squares ``(scale, min)`` for
   those levels (optimal for fixed levels). Each half-step can only lower the error; a group only
   takes the new parameters when its error went down, so degenerate solves are harmless.

Symmetric (GGUF Q4_0 style, ``min = -8 * scale``): the same two stages with one free parameter.
The candidates map the group's largest-magnitude weight onto level -8 or +7 (times a shrink
factor); the scale may come out negative, which is how Q4_0 uses the extra negative level for
whichever sign holds the largest weight. ``min = -8 * scale`` still holds exactly.

Clipped weights (outside the chosen range) are off by more than half a step: that is the point
(they trade a larger error on one outlier for a finer grid for the rest of the group).

Importance: ``weights`` (broadcastable to ``[N, G, g]``) scales each element's squared error.
Pass the mean squared activation of each input feature (reshaped ``[1, G, g]``) so the fit favours
inputs that carry signal: ``sum_j E[x_j^2] (w_j - w'_j)^2`` is the diagonal part of the expected
output error ``E[(x . (w - w'))^2]``.
"""

from __future__ import annotations

import torch

from llmd.quant.common import grouped, pack_int4
from llmd.quant.int4 import GROUP_SIZES, Int4Weight

# Candidate clipping, as (bottom, top) fractions of the group range cut off before least squares
# re-fits each candidate. The error surface is bumpy (it changes each time a weight crosses a level
# boundary), so more candidates keep finding a little more; these nine capture most of what a
# 16 x 16 grid finds at a twentieth of the cost (measured on SmolLM2-135M, see the report).
ASYM_CANDIDATES = ((0.0, 0.0), (0.06, 0.0), (0.0, 0.06), (0.06, 0.06), (0.12, 0.0), (0.0, 0.12),
                   (0.12, 0.12), (0.06, 0.12), (0.12, 0.06), (0.2, 0.2))
# Symmetric: fraction cut off the largest magnitude, which goes to level -8 and to level +7.
SYM_CANDIDATES = (0.0, 0.05, 0.1, 0.15, 0.2, 0.25)
REFINE_ROUNDS = 3
_CHUNK = 30_000  # elements per slice: temporaries stay in cache, and under torch's parallel grain (32768)
_EPS = 1e-12
_ROUND = 12582912.0  # 1.5 * 2^23


def _levels(x: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """Nearest level 0..15 for each element: the optimal ``q`` for fixed ``(scale, min)``."""
    inv = 1.0 / torch.where(scale.abs() < _EPS, torch.full_like(scale, _EPS), scale)
    q = torch.addcmul((-mn * inv)[..., None], x, inv[..., None]).clamp_(0.0, 15.0)
    # Round half to even as torch.round does, by adding and removing 1.5 * 2^23 (in [2^23, 2^24)
    # the fp32 spacing is 1). Same result, but plain adds: torch's rounding ops go multithreaded
    # even on small slices and, with every core busy, cost milliseconds per call instead of µs.
    return q.add_(_ROUND).sub_(_ROUND)


class _Fit:
    """One slice of groups: the running best ``(scale, min)`` with its error, and the weighted
    sums every candidate needs (computed once)."""

    def __init__(self, x: torch.Tensor, w: torch.Tensor | None, symmetric: bool) -> None:
        self.x, self.w, self.symmetric = x, w, symmetric
        # The 2x2 solve runs in float64: the per-group sums are tiny tensors, and in float32 the
        # normal equations lose enough digits to pick a worse candidate now and then.
        self.sw = (torch.full(x.shape[:-1], float(x.shape[-1])) if w is None else w.expand_as(x).sum(-1)).double()
        self.swx = (x if w is None else w * x).sum(-1).double()
        self.scale = self.mn = self.err = None

    def error(self, q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
        """Weighted squared error, measured directly (the closed form ``Swxx - s Swqx - m Swx`` is
        cheaper but only holds at the exact optimum: its rounding noise can make a worse
        candidate look better than an exact fit)."""
        d = torch.addcmul(mn[..., None] - self.x, q, scale[..., None])
        return torch.linalg.vecdot(d if self.w is None else d * self.w, d)

    def solve(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Weighted least squares for the parameters given ``q``, and the error they leave.

        Groups where the system is singular (every element on one level, or no weight) get an
        infinite error, so the caller keeps what it had."""
        wq = q if self.w is None else q * self.w
        if self.symmetric:  # x ~ s (q - 8): s = Sw(q-8)x / Sw(q-8)^2
            swq, swqq, swqx = wq.sum(-1).double(), torch.linalg.vecdot(wq, q).double(), torch.linalg.vecdot(wq, self.x).double()
            den = swqq - 16.0 * swq + 64.0 * self.sw
            num = swqx - 8.0 * self.swx
            ok = den > 0
            scale = num / torch.where(ok, den, torch.ones_like(den))
            mn = -8.0 * scale
        else:
            swq, swqq, swqx = wq.sum(-1).double(), torch.linalg.vecdot(wq, q).double(), torch.linalg.vecdot(wq, self.x).double()
            # Normal equations [Swqq Swq; Swq Sw] [s; m] = [Swqx; Swx].
            det = self.sw * swqq - swq * swq
            ok = det > 1e-9 * self.sw * swqq
            det = torch.where(ok, det, torch.ones_like(det))
            scale = (self.sw * swqx - swq * self.swx) / det
            mn = (swqq * self.swx - swq * swqx) / det
        scale, mn = scale.float(), mn.float()
        err = self.error(q, scale, mn)
        return scale, mn, torch.where(ok, err, torch.full_like(err, float("inf")))

    def consider(self, scale: torch.Tensor, mn: torch.Tensor, err: torch.Tensor) -> None:
        if self.err is None:
            self.scale, self.mn, self.err = scale, mn, err
            return
        better = err < self.err  # strict: ties keep the earlier (less clipped) candidate
        self.scale = torch.where(better, scale, self.scale)
        self.mn = torch.where(better, mn, self.mn)
        self.err = torch.where(better, err, self.err)

    def start(self, scale: torch.Tensor, mn: torch.Tensor) -> None:
        """Take ``(scale, min)`` as they are (min/max)."""
        self.consider(scale, mn, self.error(_levels(self.x, scale, mn), scale, mn))

    def refit(self, scale: torch.Tensor, mn: torch.Tensor) -> None:
        self.consider(*self.solve(_levels(self.x, scale, mn)))


def _fit_slice(x: torch.Tensor, w: torch.Tensor | None, symmetric: bool, candidates, rounds: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    fit = _Fit(x, w, symmetric)
    lo, hi = x.amin(-1), x.amax(-1)
    if symmetric:
        # Largest-magnitude weight, with its sign: mapping it onto -8 uses all 16 levels.
        amax = torch.where(hi >= -lo, hi, lo)
        s0 = amax.abs().clamp(min=_EPS) / 7.0
        fit.start(s0, -8.0 * s0)  # exactly quantize_int4(symmetric=True): never worse than it
        for f in candidates:
            for level in (-8.0, 7.0):
                s = amax * (1.0 - f) / level
                fit.refit(s, -8.0 * s)
    else:
        rng = hi - lo
        fit.start((rng / 15.0).clamp(min=_EPS), lo)  # exactly quantize_int4: never worse than it
        for a, b in candidates:
            lo_c = lo + a * rng
            fit.refit((rng * ((1.0 - a - b) / 15.0)).clamp(min=_EPS), lo_c)
    # Alternate nearest-level assignment and least squares; only improvements are kept.
    for _ in range(rounds):
        fit.refit(fit.scale, fit.mn)
    return fit.scale, fit.mn


@torch.no_grad()
def fit_int4_groups(wg: torch.Tensor, symmetric: bool, weights: torch.Tensor | None = None,
                    candidates=None, rounds: int = REFINE_ROUNDS) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group ``(scales [N, G], mins [N, G])`` minimising ``sum w * (scale*q + min - x)^2``.

    ``wg``: ``[N, G, g]`` float32 groups. ``symmetric``: ``min = -8 * scale`` (the scale may be
    negative, as in GGUF Q4_0). ``weights``: optional non-negative importance broadcastable to
    ``wg`` (e.g. ``[1, G, g]`` per input feature); ``None`` weighs every element equally.
    ``candidates``/``rounds`` override the clipping grid (``ASYM_CANDIDATES`` or
    ``SYM_CANDIDATES``) and the refinement rounds (see the module docstring). The levels to
    store are :func:`assign_levels` of the result.
    """
    x = wg.float()
    if candidates is None:
        candidates = SYM_CANDIDATES if symmetric else ASYM_CANDIDATES
    w = None if weights is None else weights.to(x.dtype)
    if w is not None and w.dim() < x.dim():
        w = w.reshape((1,) * (x.dim() - w.dim()) + tuple(w.shape))
    n = x.shape[0]
    rows = max(1, _CHUNK // max(1, x[0].numel()))
    scales, mins = torch.empty(x.shape[:-1]), torch.empty(x.shape[:-1])
    for r in range(0, n, rows):
        ws = w if w is None or w.shape[0] == 1 else w[r:r + rows]
        scales[r:r + rows], mins[r:r + rows] = _fit_slice(x[r:r + rows], ws, symmetric, candidates, rounds)
    return scales, mins


def assign_levels(wg: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """``q`` in 0..15 (float) for ``[N, G, g]`` groups and their fitted parameters."""
    return _levels(wg.float(), scales, mins)


def quantize_int4_fitted(weight: torch.Tensor, group_size: int = 128, symmetric: bool = False,
                         importance: torch.Tensor | None = None) -> Int4Weight:
    """Drop-in for :func:`llmd.quant.int4.quantize_int4` using :func:`fit_int4_groups`.

    ``importance``: optional ``[K]`` per-input-feature weight (mean squared activation)."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {GROUP_SIZES}, got {group_size}")
    w = weight.float()
    wg = grouped(w, group_size)
    imp = None if importance is None else importance.float().reshape(1, wg.shape[1], group_size)
    scales, mins = fit_int4_groups(wg, symmetric, imp)
    q = assign_levels(wg, scales, mins)
    return Int4Weight(pack_int4(q.reshape(w.shape)), scales, mins, group_size)
