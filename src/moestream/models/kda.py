"""Kimi Delta Attention (KDA): short causal convolutions with carried history, L2-normalised q/k,
per-channel decay gate, the delta-rule recurrence over a fixed-size state per head, and a head-wise
RMSNorm followed by a sigmoid output gate. Used by Kimi Linear and Kimi K3.

Shapes: T tokens, H heads, D head dim, P = H*D, K conv width, E hidden size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _C
from .base import Ctx, Linear, linears, rms_norm, sigmoid, silu


@dataclass
class KDAState:
    """conv: the last K-1 inputs of the q|k|v convolutions [K-1, 3P]; S: the recurrent state [H, D, D]
    (key dim, value dim); length: tokens seen."""

    conv: np.ndarray
    S: np.ndarray
    length: int = 0

    def __post_init__(self) -> None:
        # what rewind needs: the state before a run of speculative positions and their projected inputs
        # (not a field: state files hold the fields)
        self.saved: tuple[np.ndarray, np.ndarray, int, Any, tuple[np.ndarray, ...]] | None = None

    def remember(self, attn: Any, projected: tuple[np.ndarray, ...]) -> None:
        """Called before attn mixes the positions of `projected` one at a time: the recurrence cannot be run
        backwards, so rewind restores this copy and mixes the positions it keeps again."""
        self.saved = (self.conv.copy(), self.S.copy(), self.length, attn, tuple(a.copy() for a in projected))

    def snapshot(self) -> tuple[np.ndarray, np.ndarray, int]:
        return self.conv.copy(), self.S.copy(), self.length

    def restore(self, snap: tuple[np.ndarray, np.ndarray, int]) -> None:
        conv, S, self.length = snap
        self.conv, self.S, self.saved = conv.copy(), S.copy(), None

    def rewind(self, length: int, ctx: Ctx) -> None:
        """Back to `length` positions, which must lie within the last remembered run."""
        if length == self.length:
            return
        saved = self.saved
        if saved is None or not saved[2] <= length <= min(self.length, saved[2] + saved[4][0].shape[0]):
            raise ValueError(f"a KDA state at {self.length} positions cannot go back to {length}")
        conv, S, start, attn, projected = saved
        self.conv, self.S, self.length = conv.copy(), S.copy(), start
        for r in range(length - start):  # one at a time, as they were mixed: the same bits
            attn.mix(tuple(a[r : r + 1] for a in projected), self, ctx)
        # positions past `length` are gone: a later rewind may only go back within what is still here
        self.saved = (conv, S, start, attn, tuple(a[: length - start] for a in projected))


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + e^x), linear above 20 as the reference computes it."""
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0)))).astype(np.float32)


def l2norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x / np.sqrt(np.add.reduce(x * x, axis=-1, keepdims=True) + np.float32(eps))  # np.sum's bits


def delta_rule_reference(
    S: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, alpha: np.ndarray, beta: np.ndarray
) -> np.ndarray:
    """The recurrence as numpy steps, token by token, in the arrays' own dtype (S [H, Dk, Dv] updated in
    place): the definition the C kernel is tested against, and the loop it replaced."""
    o = np.empty(q.shape, S.dtype)
    for t in range(q.shape[0]):
        S *= alpha[t][:, :, None]
        u = np.einsum("hkv,hk->hv", S, k[t])  # what the state predicts for k
        S += k[t][:, :, None] * ((v[t] - u) * beta[t][:, None])[:, None, :]
        o[t] = np.einsum("hkv,hk->hv", S, q[t])
    return o


def delta_rule(
    state: KDAState, q: np.ndarray, k: np.ndarray, v: np.ndarray, alpha: np.ndarray, beta: np.ndarray, threads: int
) -> np.ndarray:
    """The recurrence over T tokens, state.S [H, Dk, Dv] updated in place (csrc/kda.h; one C call, threads
    splitting heads): per token, S *= alpha (per key channel); u = k S, what the state predicts for k;
    S += k (v - u) beta; out = q S. q, k, v, alpha [T, H, D]; beta [T, H] -> out [T, H, D]."""
    T, H, D = q.shape
    state.S = np.require(state.S, np.float32, ("C", "W"))
    out = np.empty((T, H, D), np.float32)
    q, k, v, alpha, beta = (np.ascontiguousarray(a, np.float32) for a in (q, k, v, alpha, beta))
    _C.kda_recurrence(state.S, q, k, v, alpha, beta, out, T, H, D, threads)
    return out


class KDAttention:
    def __init__(
        self,
        q: Linear,
        k: Linear,
        v: Linear,
        conv: np.ndarray,  # [3P, K] f32: q, k, v channels in that order
        f_a: Linear,  # [D, E]
        f_b: Linear,  # [P, D]
        dt_bias: np.ndarray,  # [P]
        a_log: np.ndarray,  # [H]
        b: Linear,  # [H, E]
        gate: Callable[[np.ndarray, Ctx], np.ndarray],  # x [T, E] -> [T, P] (before the sigmoid)
        o_norm: np.ndarray,  # [D]
        o: Linear,  # [E, P]
        heads: int,
        head_dim: int,
        eps: float,
        gate_lower_bound: float | None = None,
    ):
        self.q, self.k, self.v = q, k, v
        self.conv_taps = np.ascontiguousarray(np.asarray(conv, np.float32).T)  # [K, 3P]: tap j of every channel
        self.f_a, self.f_b, self.dt_bias, self.a_log = f_a, f_b, dt_bias, np.asarray(a_log, np.float32)
        self.b, self.gate, self.o_norm, self.o = b, gate, o_norm, o
        self.heads, self.head_dim, self.eps = heads, head_dim, eps
        self.lb = gate_lower_bound

    def new_cache(self) -> KDAState:
        P, K = self.heads * self.head_dim, self.conv_taps.shape[0]
        return KDAState(
            np.zeros((K - 1, 3 * P), np.float32), np.zeros((self.heads, self.head_dim, self.head_dim), np.float32)
        )

    def _conv(self, qkv: np.ndarray, state: KDAState) -> np.ndarray:
        """Causal depthwise convolution of width K over time, then SiLU; state.conv carries history."""
        K = self.conv_taps.shape[0]
        full = np.concatenate([state.conv, qkv], axis=0)  # [K-1+T, 3P]
        T = qkv.shape[0]
        out = np.zeros_like(qkv)
        term = np.empty_like(qkv)
        for j in range(K):  # out[t] = sum_j w[:, j] * full[t + j], without a temporary per tap
            np.multiply(self.conv_taps[j], full[j : j + T], out=term)
            out += term
        state.conv = full[T:].copy() if K > 1 else state.conv
        return silu(out)

    def decay(self, x: np.ndarray, ctx: Ctx, fa: np.ndarray | None = None) -> np.ndarray:
        """log of the per-channel decay, g [T, H, D] (fa: f_a(x) when the caller has it)."""
        T, H, D = x.shape[0], self.heads, self.head_dim
        fa = self.f_a(x, ctx) if fa is None else fa
        z = (self.f_b(fa, ctx) + self.dt_bias).reshape(T, H, D)
        a = np.exp(self.a_log)[None, :, None]  # one value per head
        if self.lb is None:
            return (-a * softplus(z)).astype(np.float32)
        return (np.float32(self.lb) * sigmoid(a * z)).astype(np.float32)

    def __call__(self, x: np.ndarray, cache: KDAState, ctx: Ctx) -> np.ndarray:
        return self.output(self.mix(self.project(x, ctx), cache, ctx), x, ctx)

    def project(self, x: np.ndarray, ctx: Ctx) -> tuple[np.ndarray, ...]:
        """Row by row (one call for every sequence of a step): q, k, v before the convolution [T, P] each,
        the decay alpha [T, H, D] and beta [T, H]."""
        # the five products of x in one pass of the kernels (x prepared once)
        qx, kx, vx, fa, bx = linears(x, (self.q, self.k, self.v, self.f_a, self.b), ctx)
        alpha = np.exp(self.decay(x, ctx, fa))  # [T, H, D]
        beta = sigmoid(bx)  # [T, H]
        return qx, kx, vx, alpha, beta

    def mix(self, projected: tuple[np.ndarray, ...], cache: KDAState, ctx: Ctx) -> np.ndarray:
        """One sequence's rows of project's arrays, with its state -> [T, P]."""
        qx, kx, vx, alpha, beta = projected
        state = cache
        T, H, D = qx.shape[0], self.heads, self.head_dim
        P = H * D
        qkv = self._conv(np.concatenate([qx, kx, vx], axis=1), state)  # [T, 3P]
        q = l2norm(qkv[:, :P].reshape(T, H, D)) * np.float32(D**-0.5)
        k = l2norm(qkv[:, P : 2 * P].reshape(T, H, D))
        v = qkv[:, 2 * P :].reshape(T, H, D)
        o = delta_rule(state, q, k, v, alpha, beta, ctx.threads)  # [T, H, D]
        state.length += T
        return o.reshape(T, P)

    def output(self, o: np.ndarray, x: np.ndarray, ctx: Ctx) -> np.ndarray:
        T, H, D = x.shape[0], self.heads, self.head_dim
        o = rms_norm(o.reshape(T, H, D), self.o_norm, self.eps) * sigmoid(self.gate(x, ctx).reshape(T, H, D))
        return self.o(o.reshape(T, H * D).astype(np.float32), ctx)
