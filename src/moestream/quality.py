"""Measures of how far a quantized model's outputs are from its source: KL divergence of the next-token
distributions, on a fixed sample prompt."""

from __future__ import annotations

import numpy as np

from .generate import Model

SAMPLE_TEXT = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "The quick brown fox jumps over the lazy dog. Mixture-of-experts models route every token to a few "
    "experts, and only those experts' weights are read from memory."
)


def sample_ids(model: Model, n: int = 64) -> list[int]:
    """The sample text's first n tokens, or fixed pseudo-random ids for a model without a tokenizer."""
    if model.tokenizer is not None:
        ids = model.tokenize(SAMPLE_TEXT)[:n]
        if len(ids) >= 8:
            return [i for i in ids if i < model.vocab_size]
    rng = np.random.default_rng(0)
    return [int(i) for i in rng.integers(0, model.vocab_size, n)]


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def kl_divergence(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """KL(p || q) in nats per position, from logits [T, vocab]."""
    lp, lq = log_softmax(p_logits), log_softmax(q_logits)
    return np.sum(np.exp(lp) * (lp - lq), axis=-1)
