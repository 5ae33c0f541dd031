"""Kimi Delta Attention's recurrence in C (csrc/kda.c, models/kda.delta_rule) against its numpy definition
(delta_rule_reference, the loop it replaced) computed in float64: the same arithmetic to float32 rounding; the
same bytes on every instruction set, at every thread count, and whether the tokens come at once (prefill) or one
by one (decode)."""

from __future__ import annotations

import numpy as np
import pytest

from moestream import _C
from moestream.models.kda import KDAState, delta_rule, delta_rule_reference


def inputs(T: int, H: int, D: int, seed: int = 0):
    rng = np.random.default_rng(seed)

    def unit(shape):  # l2-normalised along the last axis, as KDA's q and k
        x = rng.standard_normal(shape)
        return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)

    q = unit((T, H, D)) * np.float32(D**-0.5)
    k = unit((T, H, D))
    v = rng.standard_normal((T, H, D)).astype(np.float32)
    alpha = np.exp(-np.abs(rng.standard_normal((T, H, D))) * 0.3).astype(np.float32)  # decays in (0, 1]
    beta = (1 / (1 + np.exp(-rng.standard_normal((T, H))))).astype(np.float32)
    S0 = (0.3 * rng.standard_normal((H, D, D))).astype(np.float32)
    return S0, q, k, v, alpha, beta


def run(S0, q, k, v, alpha, beta, threads: int = 1, isa: str | None = None):
    before = _C.get_isa()
    try:
        if isa is not None:
            _C.set_isa(isa)
        state = KDAState(np.zeros((0, 0), np.float32), S0.copy())
        out = delta_rule(state, q, k, v, alpha, beta, threads)
    finally:
        _C.set_isa(before)
    return out, state.S


# D: a tiny head, AVX2's 64-column chunk plus a tail, AVX-512's 128 (K3) and 128 plus a tail
@pytest.mark.parametrize("T,H,D", [(1, 1, 8), (5, 3, 24), (7, 2, 72), (6, 3, 128), (3, 2, 136)])
def test_matches_the_numpy_loop(T, H, D):
    S0, q, k, v, alpha, beta = inputs(T, H, D)
    S_ref = S0.astype(np.float64)
    ref = delta_rule_reference(S_ref, *(a.astype(np.float64) for a in (q, k, v, alpha, beta)))
    out, S = run(S0, q, k, v, alpha, beta)
    assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max()
    assert np.abs(S - S_ref).max() <= 1e-5 * np.abs(S_ref).max()


@pytest.mark.parametrize("T,H,D", [(4, 3, 24), (5, 4, 72), (3, 5, 136), (2, 4, 128)])
def test_same_bits_on_every_isa_and_thread_count(T, H, D):
    args = inputs(T, H, D, seed=1)
    results = {
        (isa, threads): tuple(a.tobytes() for a in run(*args, threads=threads, isa=isa))
        for isa in _C.supported_isas()
        for threads in (1, 2, 3)
    }
    assert len(set(results.values())) == 1, list(results)


def test_tokens_at_once_equal_one_by_one():
    """Prefill (all tokens in one call) gives the bits of decode (one call per token), state and output."""
    S0, q, k, v, alpha, beta = inputs(9, 3, 72, seed=2)
    whole, S_whole = run(S0, q, k, v, alpha, beta, threads=2)
    state = KDAState(np.zeros((0, 0), np.float32), S0.copy())
    steps = np.concatenate([delta_rule(state, *(a[t : t + 1] for a in (q, k, v, alpha, beta)), 2) for t in range(9)])
    assert steps.tobytes() == whole.tobytes() and state.S.tobytes() == S_whole.tobytes()


def test_inputs_of_any_layout_and_a_read_only_state():
    """Strided views (v is a slice of the q|k|v convolution output) and a state restored read-only from a
    file are taken: the result is that of contiguous copies."""
    S0, q, k, v, alpha, beta = inputs(4, 2, 24, seed=3)
    wide = np.concatenate([q, k, v], axis=-1)  # [T, H, 3D]: v a strided view of it
    frozen = S0.copy()
    frozen.flags.writeable = False
    state = KDAState(np.zeros((0, 0), np.float32), frozen)
    out = delta_rule(state, q, k, wide[..., 2 * 24 :], alpha, beta, 1)
    want, S_want = run(S0, q, k, v, alpha, beta)
    assert out.tobytes() == want.tobytes() and state.S.tobytes() == S_want.tobytes()
    assert frozen.tobytes() == S0.tobytes()  # the read-only array itself is left alone


def test_bad_arguments_raise():
    S0, q, k, v, alpha, beta = inputs(2, 2, 8)
    out = np.empty_like(q)

    def call(**change):
        a = dict(S=S0.copy(), q=q, k=k, v=v, alpha=alpha, beta=beta, out=out, T=2, H=2, D=8)
        a.update(change)
        _C.kda_recurrence(a["S"], a["q"], a["k"], a["v"], a["alpha"], a["beta"], a["out"], a["T"], a["H"], a["D"], 1)

    call()
    read_only = S0.copy()
    read_only.flags.writeable = False
    for change in (
        dict(T=3),
        dict(D=4),
        dict(T=-2),
        dict(beta=beta[:1]),
        dict(S=S0[:1].copy()),
        dict(q=q.astype(np.float64)),
        dict(S=read_only),
        dict(v=np.concatenate([v, v], axis=-1)[..., :8]),  # not contiguous
    ):
        with pytest.raises(ValueError):
            call(**change)
