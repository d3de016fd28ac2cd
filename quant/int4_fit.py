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
Pass the mean squared activation of each input feature (reshaped ``[1, G, g]``, see
:func:`input_importance`) so the fit favours inputs that carry signal: ``sum_j E[x_j^2] (w_j -
w'_j)^2`` is the diagonal part of the expected output error ``E[(x . (w - w'))^2]``.

**Use the importance.** Without it the fit lowers the weight error (-32% at g64) but hardly the
model's: the clipping it chooses lands on weights that large activations multiply. Perplexity of
SmolLM2-135M (Q4_1 weights requantised; benchmarks/quant_quality.py text, 4096 tokens; fp32
12.514): g64 min/max +26.9%, fitted +25.5%, fitted with importance +5.2%; g128 (g64 where 128
does not divide K) +35.1% / +30.0% / +6.0%; g32 reproduces Q4_1 exactly in all three.
"""

from __future__ import annotations

import torch

from llmd.quant.common import grouped, pack_int4
from llmd.quant.int4 import GROUP_SIZES, Int4Weight

# Candidate clipping, as (bottom, top) fractions of the group range cut off before least squares
# re-fits each candidate. The error surface is bumpy (it changes each time a weight crosses a level
# boundary), so more candidates keep finding a little more, but slowly: on SmolLM2-135M g64 these
# ten get 95% of the weight-error reduction of a 235-point grid (steps of 0.02) at a sixteenth of
# the cost, and a 133-point grid gave the same perplexity. Outliers are usually one-sided, hence
# independent bottom and top cuts.
ASYM_CANDIDATES = ((0.0, 0.0), (0.06, 0.0), (0.0, 0.06), (0.06, 0.06), (0.12, 0.0), (0.0, 0.12),
                   (0.12, 0.12), (0.06, 0.12), (0.12, 0.06), (0.2, 0.2))
# Symmetric: fraction cut off the largest magnitude, which goes to level -8 and to level +7.
SYM_CANDIDATES = (0.0, 0.05, 0.1, 0.15, 0.2, 0.25)
REFINE_ROUNDS = 3
# Elements per slice. Below torch's parallel grain (32768) every op runs on the calling thread:
# intra-op threads help little at this size, and when the other cores are busy (a loaded machine)
# waiting for them made the fit 10-50x slower. Small slices also keep the temporaries in cache.
_CHUNK = 30_000
_EPS = 1e-12
_MIN_SCALE = 2.0 ** -14  # as llmd.quant.int4: fp16's smallest normal number, for stored scales
_ROUND = 12582912.0  # 1.5 * 2^23


def _levels(x: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """Nearest level 0..15 for each element: the optimal ``q`` for fixed ``(scale, min)``.

    A zero scale gives NaN levels, hence a NaN error, which never compares as better."""
    inv = scale.reciprocal()
    q = (x * inv[..., None]).sub_((mn * inv)[..., None]).clamp_(0.0, 15.0)
    # Round half to even as torch.round does, by adding and removing 1.5 * 2^23 (in [2^23, 2^24)
    # the fp32 spacing is 1). Same result, but plain adds: torch's rounding ops go multithreaded
    # even on small slices and, with every core busy, cost milliseconds per call instead of µs.
    # (Separate ops rather than addcmul, whose broadcasting path is several times slower.)
    return q.add_(_ROUND).sub_(_ROUND)


class _Fit:
    """One slice of groups: the running best ``(scale, min)`` with its error, and the weighted
    sums every candidate needs (computed once)."""

    def __init__(self, x: torch.Tensor, w: torch.Tensor | None, symmetric: bool) -> None:
        self.x, self.w, self.symmetric = x, w, symmetric
        self.sw = torch.full(x.shape[:-1], float(x.shape[-1])) if w is None else w.sum(-1)
        self.swx = (x if w is None else w * x).sum(-1)
        self.scale = self.mn = self.err = None

    def error(self, q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
        """Weighted squared error, measured directly (the closed form ``Swxx - s Swqx - m Swx`` is
        cheaper but only holds at the exact optimum: its rounding noise can make a worse
        candidate look better than an exact fit, e.g. an unchanged Q4_1 block)."""
        d = (q * scale[..., None]).add_(mn[..., None]).sub_(self.x)
        return torch.linalg.vecdot(d if self.w is None else d * self.w, d)

    def solve(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Weighted least squares for the parameters given ``q``, and the error they leave.

        Solved around the weighted mean level ``qm`` (``Sqq = Swqq - qm Swq`` keeps the
        cancellation small: levels are 0..15). A group whose levels are all equal (or that has
        no weight) has no solution: NaN/inf error, never taken."""
        wq = q if self.w is None else q * self.w
        swq, swqq, swqx = wq.sum(-1), torch.linalg.vecdot(wq, q), torch.linalg.vecdot(wq, self.x)
        if self.symmetric:  # x ~ s (q - 8): s = Sw(q-8)x / Sw(q-8)^2
            scale = (swqx - 8.0 * self.swx) / (swqq - 16.0 * swq + 64.0 * self.sw)
            mn = -8.0 * scale
        else:
            qm = swq / self.sw
            scale = (swqx - qm * self.swx) / (swqq - qm * swq)
            mn = (self.swx - scale * swq) / self.sw
        return scale, mn, self.error(q, scale, mn)

    def consider(self, scale: torch.Tensor, mn: torch.Tensor, err: torch.Tensor) -> None:
        if self.err is None:
            self.scale, self.mn, self.err = scale, mn, err
            return
        better = err < self.err  # strict: ties keep the earlier (less clipped) candidate; NaN never wins
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
    if x.dim() != 3:
        raise ValueError(f"expected [N, G, g] groups, got shape {tuple(x.shape)}")
    if candidates is None:
        candidates = SYM_CANDIDATES if symmetric else ASYM_CANDIDATES
    w = None
    if weights is not None:
        if (weights < 0).any():
            raise ValueError("importance weights must be non-negative")
        w = weights.to(x.dtype).expand_as(x)  # a view: a [1, G, g] importance is not copied N times
    rows = max(1, _CHUNK // max(1, x[0].numel()))
    scales, mins = torch.empty(x.shape[:-1]), torch.empty(x.shape[:-1])
    for r in range(0, x.shape[0], rows):
        ws = None if w is None else w[r:r + rows]
        scales[r:r + rows], mins[r:r + rows] = _fit_slice(x[r:r + rows], ws, symmetric, candidates, rounds)
    return scales, mins


def assign_levels(wg: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """``q`` in 0..15 (float) for ``[N, G, g]`` groups and their fitted parameters."""
    safe = torch.where(scales == 0, torch.ones_like(scales), scales)  # all-equal group: q = 0
    return _levels(wg.float(), safe, mins)


def quantize_int4_fitted(weight: torch.Tensor, group_size: int = 128, symmetric: bool = False,
                         importance: torch.Tensor | None = None, **fit_options) -> Int4Weight:
    """Drop-in for :func:`llmd.quant.int4.quantize_int4` using :func:`fit_int4_groups`.

    ``importance``: optional ``[K]`` per-input-feature weight (mean squared activation, see
    :func:`input_importance`). ``fit_options`` go to :func:`fit_int4_groups`. As in
    ``quantize_int4``, scales and mins are rounded to fp16 (the stored format) before the levels
    are chosen, so the levels are the nearest ones for the parameters actually stored."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {GROUP_SIZES}, got {group_size}")
    w = weight.float()
    wg = grouped(w, group_size)
    imp = None if importance is None else importance.float().reshape(1, wg.shape[1], group_size)
    scales, mins = fit_int4_groups(wg, symmetric, imp, **fit_options)
    # Keep |scale| a normal fp16 number (a symmetric scale may be negative: keep its sign).
    sign = torch.where(scales < 0, -1.0, 1.0)
    scales = (sign * scales.abs().clamp(min=_MIN_SCALE)).half()
    mins = (-8.0 * scales.float()).half() if symmetric else mins.half()
    q = assign_levels(wg, scales.float(), mins.float())
    return Int4Weight(pack_int4(q.reshape(w.shape)), scales, mins, group_size)


def input_importance(modules, run) -> dict:
    """Mean squared input activation per input feature, ``{module: [in_features]}``, of each of
    ``modules`` (Linears) while ``run()`` executes a forward pass over calibration text.

    These are the ``importance`` for :func:`quantize_int4_fitted`. A few hundred tokens suffice
    and the text need not match the use: on SmolLM2-135M (perplexity on stdlib docstrings), 512
    tokens of other stdlib docstrings gave g64 +5.2%, g128 +6.0%; 512 tokens of the GPL-3 text
    +5.7%, +7.4%; 2048 tokens did no better than 512."""
    sums: dict = {}

    def hook(module, args) -> None:
        x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
        total, count = sums.get(module, (0.0, 0))
        sums[module] = (total + x.pow(2).sum(0), count + x.shape[0])

    handles = [m.register_forward_pre_hook(hook) for m in modules]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return {m: total / count for m, (total, count) in sums.items()}
