"""model_stock's and karcher's per-tensor scalars, computed with whole-array steps, equal the pair-by-pair and
model-by-model loops they replaced (mergekit's order of float operations), bit for bit: the plans' coefficients,
and so their digests, do not change."""

from __future__ import annotations

import math

import numpy as np
import torch

from mergepipe.ops import karcher, model_stock
from mergepipe.ops.interp import Gram, f32


def _model_stock_loop(gram: Gram) -> list[float]:
    k = len(gram.bd)
    norms = [float(f32(gram.dnorm(i))) for i in range(k)]
    cos_thetas = []
    for i in range(k):
        for j in range(i + 1, k):
            norm_product = float(f32(norms[i]) * f32(norms[j]))
            cos_thetas.append(f32(gram.dd[i][j] / max(norm_product, 1e-6)).clamp(-1, 1).reshape(()))
    cos_theta = torch.stack(cos_thetas).mean(dim=0).unsqueeze(-1)
    return [float(model_stock._ratio(cos_theta, k))]


def _karcher_loop(gram: Gram, params: dict) -> list[float]:
    k = len(gram.bd)
    n = k + 1
    g = np.zeros((n, n))
    for i in range(k):
        for j in range(k):
            g[i, j] = gram.xx(i, j)
        g[i, k] = g[k, i] = gram.bx(i)
    g[k, k] = gram.bb
    max_iter, tol = int(params["max_iter"]), params["tol"]
    alphas = [1.0 / n] * n
    norms = [float(f32(math.sqrt(max(g[i, i], 0.0)))) for i in range(n)]

    def unit(i):
        c = np.zeros(n)
        if norms[i] != 0.0:
            c[i] = 1.0 / norms[i]
        return c

    def norm(c):
        return math.sqrt(max(float(c @ g @ c), 0.0))

    valid = [i for i in range(n) if norms[i] > tol]
    if not valid:
        return [0.0] * n
    asum = sum(alphas[i] for i in valid)
    na = [alphas[i] / asum for i in valid]
    units = [unit(i) for i in valid]
    mean = sum(a * u for a, u in zip(na, units))
    mn = norm(mean)
    mean = units[0].copy() if mn < tol else mean / mn
    for _ in range(max_iter):
        tangent = np.zeros(n)
        for a, u in zip(na, units):
            dot = min(1.0, max(-1.0, float(mean @ g @ u)))
            theta = math.acos(dot)
            if theta < tol:
                continue
            tangent += a * (theta / math.sin(theta)) * (u - dot * mean)
        tn = norm(tangent)
        if tn < tol:
            break
        mean = math.cos(tn) * mean + math.sin(tn) * (tangent / tn)
        un = norm(mean)
        if un > tol:
            mean = mean / un
    scale = sum(a * nm for a, nm in zip(alphas, norms))
    return [float(v) for v in scale * mean]


def _grams(seed: int, count: int):
    rng = np.random.default_rng(seed)
    for trial in range(count):
        k = int(rng.integers(2, 70))
        d = int(rng.integers(1, 40))
        base = rng.standard_normal(d) * (0.0 if trial % 13 == 0 else 1.0)
        x = rng.standard_normal((k, d)) * 10.0 ** float(rng.integers(-6, 2))
        if trial % 5 == 0:
            x[rng.integers(0, k)] = 0.0  # a zero task vector
        if trial % 9 == 0:
            x[rng.integers(0, k)] = -base
        if trial % 17 == 0:
            x[:] = x[0]  # all alike: theta 0
        dd = x @ x.T
        if trial % 7 == 0:
            dd = dd + rng.standard_normal((k, k)) * 1e-3  # not a Gram matrix: negative norms, |cos| > 1
        yield trial, Gram(float(base @ base), tuple((x @ base).tolist()), tuple(map(tuple, dd.tolist())), d)


def _outcome(fn):
    try:
        return repr(fn())
    except (ZeroDivisionError, ValueError) as exc:
        return type(exc).__name__


def test_model_stock_scalars_equal_the_pair_loop():
    for _, gram in _grams(0, 150):
        assert repr(model_stock.scalars(None, gram, {}, {}, 2)) == repr(_model_stock_loop(gram))


def test_karcher_scalars_equal_the_model_loop():
    rng = np.random.default_rng(1)
    for _, gram in _grams(1, 120):
        params = {"max_iter": float(rng.choice([0, 1, 3, 10])), "tol": float(rng.choice([1e-5, 1e-9, 0.0, 1e-2]))}
        with np.errstate(all="ignore"):
            assert (_outcome(lambda: karcher.scalars(None, gram, {}, params, 2))
                    == _outcome(lambda: _karcher_loop(gram, params)))
