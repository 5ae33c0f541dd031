"""Train the demo Kimi K3 model from scratch on the Python standard library's own source files.

    python3 tools/train_demo.py --out runs/demo --steps 2400          # train (resumes from runs/demo/ckpt.pt)
    python3 tools/train_demo.py --out runs/demo --export DIR           # write the K3 checkpoint from ckpt.pt

Everything is deterministic from --seed: the corpus split (by a hash of each file's path), the byte-level BPE
tokenizer (trained with `tokenizers`, written as tiktoken.model like a real K3 checkpoint), the initial weights
and the batches (a function of the seed and the step, so a resumed run sees the same data). The model is the
`kimi_k3` architecture written in plain PyTorch from ../shared/specs/kimi_k3.md: KDA (chunked, exact) and gated
NoPE MLA layers, attention residuals over blocks, SiTU-GLU, a dense first layer, latent MoE with shared experts
and a sigmoid router whose correction bias is trained without an auxiliary loss (DeepSeek-style updates).
Tensor names and shapes come from moestream's own inventory of the architecture, so the export is exactly what
the engine reads. Torch is a tool dependency here, never a runtime one.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import sysconfig
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from moestream.models.inventory import tensor_shapes
from moestream.quant.formats import quantize_mxfp4_reference
from moestream.synth import KIMI_PAT, kimi_tokenizer, make_config, tensor_dtype, write_checkpoint

HELD_OUT_PERCENT = 3
N_MERGES = 1792 - 256  # BPE tokens = 256 bytes + merges; 256 Kimi specials on top: vocab 2048
PREFIX = "language_model."

# The demo model's text_config (on top of synth's small kimi_k3 defaults).
DEMO: dict[str, Any] = dict(
    vocab_size=2048,
    hidden_size=256,
    num_hidden_layers=8,
    intermediate_size=768,
    attn_res_block_size=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=128,
    kv_lora_rank=64,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    num_experts=16,
    num_experts_per_token=2,
    num_shared_experts=2,
    routed_expert_hidden_size=192,
    moe_intermediate_size=256,
    routed_scaling_factor=1.0,
    max_position_embeddings=4096,
    linear_attn_config={
        "num_heads": 4,
        "head_dim": 64,
        "short_conv_kernel_size": 4,
        "gate_lower_bound": -5.0,
        "full_attn_layers": [4, 8],
        "kda_layers": [1, 2, 3, 5, 6, 7],
    },
)


# ---- data ----------------------------------------------------------------------------------------------------


@functools.cache
def stdlib_files() -> tuple[tuple[str, str], ...]:
    """(relative path, text) of every UTF-8 .py file of this Python's standard library, sorted by path
    (read once a process)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if rel.startswith("site-packages/") or "/site-packages/" in rel:
            continue
        try:
            out.append((rel, p.read_bytes().decode("utf-8")))
        except UnicodeDecodeError:
            continue
    return tuple(out)


def is_held_out(rel: str) -> bool:
    return zlib.crc32(rel.encode()) % 100 < HELD_OUT_PERCENT


@functools.cache
def training_tokens() -> tuple[bytes, ...]:
    """The demo's BPE tokens: train_bpe over the training files with N_MERGES merges (trained once a
    process; it takes seconds)."""
    return tuple(train_bpe([text for rel, text in stdlib_files() if not is_held_out(rel)], N_MERGES))


def train_bpe(texts: list[str], n_merges: int) -> list[bytes]:
    """Byte-level BPE on Kimi's pre-tokenizer pattern: the 256 bytes (ranks 0..255 in byte order), then the
    merged tokens in the order the trainer made them (which is the rank order tiktoken merges by)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE())
    pattern = "|".join(KIMI_PAT)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=256 + n_merges, initial_alphabet=alphabet, show_progress=False, special_tokens=[]
    )
    tok.train_from_iterator(texts, trainer=trainer)
    byte_of = _byte_decoder()
    vocab = json.loads(tok.to_str())["model"]["vocab"]
    merged = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if len(t) > 1 or t not in byte_of]
    tokens = [bytes([i]) for i in range(256)] + [bytes(byte_of[c] for c in t) for t in merged]
    assert len(set(tokens)) == len(tokens)
    return tokens


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable character -> byte map (the ByteLevel pre-tokenizer's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def encoding(tokens: list[bytes]) -> Any:
    import tiktoken

    return tiktoken.Encoding(
        "kimi-demo", pat_str="|".join(KIMI_PAT), mergeable_ranks={t: i for i, t in enumerate(tokens)}, special_tokens={}
    )


class Corpus:
    """The token streams of the train and held-out files, each file as [BOS] + its tokens."""

    def __init__(self, tokens: list[bytes], bos: int):
        enc = encoding(tokens)
        files = stdlib_files()
        self.n_files = {"train": 0, "held_out": 0}
        parts: dict[str, list[np.ndarray]] = {"train": [], "held_out": []}
        for rel, text in files:
            split = "held_out" if is_held_out(rel) else "train"
            self.n_files[split] += 1
            ids = enc.encode_ordinary(text)
            parts[split].append(np.array([bos, *ids], np.int32))
        self.train = np.concatenate(parts["train"])
        self.held_out = np.concatenate(parts["held_out"])
        self.token_bytes = np.array([len(t) for t in tokens] + [0] * 4096, np.int64)
        self.bos = bos

    def batch(self, seed: int, step: int, batch: int, seq: int) -> torch.Tensor:
        rng = np.random.default_rng([seed, step])
        starts = rng.integers(0, len(self.train) - seq - 1, batch)
        return torch.from_numpy(np.stack([self.train[s : s + seq + 1] for s in starts]).astype(np.int64))


# ---- the model -----------------------------------------------------------------------------------------------


def situ(g: torch.Tensor, u: torch.Tensor, b1: float, b2: float) -> torch.Tensor:
    capped = b1 * torch.tanh(g / b1)
    return capped * torch.sigmoid(g) * (b2 * torch.tanh(u / b2))


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)


def kda_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor, chunk: int = 16
) -> torch.Tensor:
    """The KDA delta rule over a sequence, exactly (no approximation), a chunk at a time.
    q, k, v, g: [B, H, T, D] (g = log decay per key channel, in [lb, 0]); beta: [B, H, T]. Returns o [B, H, T, D].
    Per step: S = diag(exp g_t) S; S += k_t (beta_t (v_t - S^T k_t))^T; o_t = S^T q_t.
    Within a chunk, with G = cumsum(g) and S0 the state before it, the deltas w solve
    (I + diag(beta) A) w = beta (v - (k e^G) S0), A[t, s] = sum_c k_t k_s e^(G_t - G_s) for s < t, and
    o_t = (q_t e^G_t) S0 + sum_{s<=t} (sum_c q_t k_s e^(G_t - G_s)) w_s. The exponentials are split around the
    chunk's middle, so no factor exceeds e^(|lb| chunk / 2). Everything but the state carry is computed for all
    chunks at once."""
    B, H, T, D = q.shape
    pad = -T % chunk
    if pad:
        q, k, v, g = (F.pad(z, (0, 0, 0, pad)) for z in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    n = (T + pad) // chunk
    q, k, v, g = (z.reshape(B, H, n, chunk, D) for z in (q, k, v, g))
    beta = beta.reshape(B, H, n, chunk, 1)
    G = torch.cumsum(g, dim=3)  # [B, H, n, C, D]
    mid = G[:, :, :, chunk // 2 : chunk // 2 + 1]
    k_in, k_out = k * torch.exp(G - mid), k * torch.exp(mid - G)
    strict = torch.ones(chunk, chunk, dtype=torch.bool).tril(-1)
    A = (k_in @ k_out.transpose(-1, -2)).masked_fill(~strict, 0.0)  # [B, H, n, C, C]
    incl = torch.ones(chunk, chunk, dtype=torch.bool).tril(0)
    Bqk = ((q * torch.exp(G - mid)) @ k_out.transpose(-1, -2)).masked_fill(~incl, 0.0)
    L = torch.eye(chunk) + beta * A
    eG = torch.exp(G)
    U = torch.linalg.solve_triangular(L, beta * v, upper=False, unitriangular=True)  # [B, H, n, C, Dv]
    Wk = torch.linalg.solve_triangular(L, beta * (k * eG), upper=False, unitriangular=True)  # [B, H, n, C, Dk]
    qe = q * eG
    last = G[:, :, :, -1:]  # [B, H, n, 1, D]
    k_end = (k * torch.exp(last - G)).transpose(-1, -2)  # [B, H, n, Dk, C]
    decay_end = torch.exp(last).transpose(-1, -2)  # [B, H, n, Dk, 1]
    S = q.new_zeros(B, H, D, D)  # [B, H, Dk, Dv]
    outs = []
    for c in range(n):
        W = U[:, :, c] - Wk[:, :, c] @ S
        outs.append(qe[:, :, c] @ S + Bqk[:, :, c] @ W)
        S = decay_end[:, :, c] * S + k_end[:, :, c] @ W
    return torch.stack(outs, dim=2).reshape(B, H, n * chunk, D)[:, :, :T]


def kda_stepwise(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor
) -> torch.Tensor:
    """The same recurrence one step at a time (the check for kda_chunked)."""
    B, H, T, D = q.shape
    S = q.new_zeros(B, H, D, D)
    outs = []
    for t in range(T):
        S = torch.exp(g[:, :, t])[..., None] * S
        u = torch.einsum("bhkv,bhk->bhv", S, k[:, :, t])
        S = S + k[:, :, t, :, None] * (beta[:, :, t, None] * (v[:, :, t] - u))[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, :, t]))
    return torch.stack(outs, dim=2)


class K3(nn.Module):
    """Kimi K3 in training form. Parameters are keyed by checkpoint name ('.' -> ':'); routed experts of a
    layer are stacked ([n, I, L] / [n, L, I]) and exported one by one."""

    def __init__(self, config: dict[str, Any], seed: int):
        super().__init__()
        self.c = c = config["text_config"]
        self.eps = c["rms_norm_eps"]
        lac = c["linear_attn_config"]
        self.mla_layers = {i - 1 for i in lac["full_attn_layers"]}
        self.H, self.D = lac["num_heads"], lac["head_dim"]
        self.K = lac["short_conv_kernel_size"]
        self.lb = lac["gate_lower_bound"]
        self.shapes = tensor_shapes(config)
        self.n_exp = c["num_experts"]
        gen = torch.Generator().manual_seed(seed)
        params: dict[str, nn.Parameter] = {}
        experts: dict[str, dict[str, list[tuple[int, ...]]]] = {}
        for name, shape in self.shapes.items():
            short = name[len(PREFIX) :]
            if ".experts." in short and "shared_experts" not in short:
                layer, _, rest = short.partition(".experts.")
                _e, proj = rest.split(".")[:2]
                if name.endswith(".weight_packed"):
                    experts.setdefault(layer, {}).setdefault(proj, []).append((shape[0], shape[1] * 2))
                continue
            params[short] = nn.Parameter(self._init(short, shape, gen))
        for layer, projs in experts.items():
            for proj, shapes in projs.items():
                rows, cols = shapes[0]
                w = torch.randn(len(shapes), rows, cols, generator=gen) / math.sqrt(cols)
                if proj == "w2":
                    w = w / math.sqrt(2 * c["num_hidden_layers"])
                params[f"{layer}.experts.{proj}"] = nn.Parameter(w)
        self.p = nn.ParameterDict({k.replace(".", ":"): v for k, v in params.items()})
        self.register_buffer("router_bias_load", torch.zeros(c["num_hidden_layers"], self.n_exp), persistent=False)

    def _init(self, name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
        c = self.c
        if name.endswith(".A_log"):
            return torch.zeros(self.H)  # exp(A) = 1; the decay is learned through dt_bias and f_b
        if name.endswith(".dt_bias"):
            # g = lb * sigmoid(z): start with per-channel decays between exp(-5 * 0.001) and exp(-5 * 0.1)
            return torch.logit(torch.exp(torch.empty(shape).uniform_(math.log(1e-3), math.log(0.1), generator=gen)))
        if "norm" in name:
            return torch.ones(shape)
        if name.endswith("e_score_correction_bias") or name.endswith("_res_proj.weight"):
            return torch.zeros(shape)
        if name.endswith("conv1d.weight"):
            return torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
        if name.endswith("embed_tokens.weight"):
            return torch.randn(shape, generator=gen)
        std = 1 / math.sqrt(shape[-1])
        if name.endswith(("o_proj.weight", "down_proj.weight", "routed_expert_up_proj.weight")):
            std /= math.sqrt(2 * c["num_hidden_layers"])
        return torch.randn(shape, generator=gen) * std

    def w(self, name: str) -> torch.Tensor:
        return self.p[name.replace(".", ":")]

    def lin(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x @ self.w(name + ".weight").T

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return rms(x, self.eps) * self.w(name + ".weight")

    def act(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return situ(g, u, self.c["activation_situ_beta"], self.c["activation_situ_linear_beta"])

    def mlp(self, x: torch.Tensor, p: str) -> torch.Tensor:
        return self.lin(self.act(self.lin(x, p + ".gate_proj"), self.lin(x, p + ".up_proj")), p + ".down_proj")

    def ar(self, sources: list[torch.Tensor], p: str) -> torch.Tensor:
        """Attention residual: softmax over sources of <rms(source), norm_w * proj_w>, applied to the raw sources."""
        f = self.w(p + "_norm.weight") * self.w(p + "_proj.weight")[0]
        s = torch.stack(sources)  # [n, B, T, E]
        prob = torch.softmax((rms(s, self.eps) * f).sum(-1), dim=0)  # [n, B, T]
        return (s * prob[..., None]).sum(0)

    def kda(self, x: torch.Tensor, p: str) -> torch.Tensor:
        B, T, _ = x.shape
        H, D, K = self.H, self.D, self.K

        def conv(name: str) -> torch.Tensor:
            y = self.lin(x, f"{p}.{name}_proj").transpose(1, 2)  # [B, P, T]
            y = F.conv1d(F.pad(y, (K - 1, 0)), self.w(f"{p}.{name}_conv1d.weight"), groups=y.shape[1])
            return F.silu(y).view(B, H, D, T).transpose(2, 3)  # [B, H, T, D]

        q, k, v = conv("q"), conv("k"), conv("v")
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * D**-0.5
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        beta = torch.sigmoid(self.lin(x, p + ".b_proj")).transpose(1, 2)  # [B, H, T]
        z = self.lin(self.lin(x, p + ".f_a_proj"), p + ".f_b_proj") + self.w(p + ".dt_bias")
        z = z.view(B, T, H, D).transpose(1, 2)
        a = torch.exp(self.w(p + ".A_log"))[None, :, None, None]
        g = self.lb * torch.sigmoid(a * z)  # [B, H, T, D]
        o = kda_chunked(q, k, v, beta, g).transpose(1, 2)  # [B, T, H, D]
        o = self.norm(o, p + ".o_norm") * torch.sigmoid(self.lin(x, p + ".g_proj")).view(B, T, H, D)
        return self.lin(o.reshape(B, T, H * D), p + ".o_proj")

    def mla(self, x: torch.Tensor, p: str) -> torch.Tensor:
        c = self.c
        B, T, _ = x.shape
        H = c["num_attention_heads"]
        N, R, V, Cr = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
        q = self.lin(self.norm(self.lin(x, p + ".q_a_proj"), p + ".q_a_layernorm"), p + ".q_b_proj")
        q = q.view(B, T, H, N + R).transpose(1, 2)  # [B, H, T, N+R]
        ckv = self.lin(x, p + ".kv_a_proj_with_mqa")
        kv = self.lin(self.norm(ckv[..., :Cr], p + ".kv_a_layernorm"), p + ".kv_b_proj")
        kv = kv.view(B, T, H, N + V).transpose(1, 2)
        k_r = ckv[..., Cr:][:, None].expand(B, H, T, R)  # shared by all heads, no rotation (NoPE)
        k = torch.cat([kv[..., :N], k_r], -1)
        o = F.scaled_dot_product_attention(q, k, kv[..., N:], is_causal=True, scale=(N + R) ** -0.5)
        o = o.transpose(1, 2).reshape(B, T, H * V) * torch.sigmoid(self.lin(x, p + ".g_proj"))
        return self.lin(o, p + ".o_proj")

    def moe(self, x: torch.Tensor, p: str, layer: int, quantized: dict[str, torch.Tensor] | None) -> torch.Tensor:
        c = self.c
        B, T, E = x.shape
        xf = x.reshape(B * T, E)
        k = c["num_experts_per_token"]
        s = torch.sigmoid(self.lin(xf, p + ".gate"))  # [N, n]
        sel = s + self.w(p + ".gate.e_score_correction_bias")
        idx = torch.sort(sel.detach(), dim=-1, descending=True, stable=True).indices[:, :k]  # [N, k]
        weights = torch.gather(s, 1, idx)
        if c["moe_renormalize"]:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights * c["routed_scaling_factor"]
        z = self.lin(xf, p + ".routed_expert_down_proj")  # [N, L]
        acc = torch.zeros_like(z)
        w1, w3, w2 = (
            quantized[f"{p}.experts.{n}"] if quantized else self.w(f"{p}.experts.{n}") for n in ("w1", "w3", "w2")
        )
        counts = torch.bincount(idx.reshape(-1), minlength=self.n_exp)
        if torch.is_grad_enabled():
            self.router_bias_load[layer] += counts.to(torch.float32)
        for e in torch.nonzero(counts).reshape(-1).tolist():
            rows, slot = torch.nonzero(idx == e, as_tuple=True)
            ze = z[rows]
            h = self.act(ze @ w1[e].T, ze @ w3[e].T) @ w2[e].T
            acc = acc.index_add(0, rows, h * weights[rows, slot][:, None])
        out = self.lin(self.norm(acc, p + ".routed_expert_norm"), p + ".routed_expert_up_proj")
        return (out + self.mlp(xf, p + ".shared_experts")).view(B, T, E)

    def forward(self, ids: torch.Tensor, quantized: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        c = self.c
        h = self.w("model.embed_tokens.weight")[ids]
        blocks: list[torch.Tensor] = []
        for layer in range(c["num_hidden_layers"]):
            p = f"model.layers.{layer}"
            prefix: torch.Tensor | None = h
            if blocks:
                h = self.ar([*blocks, h], p + ".self_attention_res")
            if layer % c["attn_res_block_size"] == 0:
                blocks.append(prefix)
                prefix = None
            x = self.norm(h, p + ".input_layernorm")
            a = self.mla(x, p + ".self_attn") if layer in self.mla_layers else self.kda(x, p + ".self_attn")
            prefix = a if prefix is None else prefix + a
            h = self.ar([*blocks, prefix], p + ".mlp_res")
            x = self.norm(h, p + ".post_attention_layernorm")
            if layer < c["first_k_dense_replace"]:
                m = self.mlp(x, p + ".mlp")
            else:
                m = self.moe(x, p + ".block_sparse_moe", layer, quantized)
            h = prefix + m
        h = self.ar([*blocks, h], "model.output_attn_res")
        return self.lin(self.norm(h, "model.norm"), "lm_head")

    def update_router_bias(self, rate: float) -> None:
        """Aux-loss-free balancing: raise the bias of under-used experts, lower the over-used, by `rate`."""
        with torch.no_grad():
            for layer in range(self.c["first_k_dense_replace"], self.c["num_hidden_layers"]):
                load = self.router_bias_load[layer]
                if load.sum() == 0:
                    continue
                b = self.w(f"model.layers.{layer}.block_sparse_moe.gate.e_score_correction_bias")
                b += rate * torch.sign(load.mean() - load)
            self.router_bias_load.zero_()

    # ---- export ------------------------------------------------------------------------------------------

    def quantized_experts(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """{checkpoint prefix of one expert matrix: (weight_packed, weight_scale)} in MXFP4."""
        out = {}
        for key, param in self.p.items():
            name = key.replace(":", ".")
            if ".experts." not in name or "shared_experts" in name:
                continue
            layer, _, proj = name.partition(".experts.")
            w = param.detach().numpy()
            for e in range(w.shape[0]):
                out[f"{PREFIX}{layer}.experts.{e}.{proj}"] = quantize_mxfp4_reference(w[e])
        return out

    def dequantized_experts(self) -> dict[str, torch.Tensor]:
        """The stacked expert weights after an MXFP4 round trip (for held-out loss after conversion)."""
        from moestream.quant.formats import FORMATS, dequantize_reference

        q = self.quantized_experts()
        out: dict[str, list[torch.Tensor]] = {}
        for name, (packed, scale) in q.items():
            layer, _, rest = name[len(PREFIX) :].partition(".experts.")
            _e, proj = rest.split(".")
            w = dequantize_reference(FORMATS["mxfp4"], packed, scale, packed.shape[0], packed.shape[1] * 2)
            out.setdefault(f"{layer}.experts.{proj}", []).append(torch.from_numpy(np.asarray(w, np.float32)))
        return {k: torch.stack(v) for k, v in out.items()}

    def export(self, out: Path, config: dict[str, Any], files: dict[str, str]) -> None:
        import ml_dtypes

        q = self.quantized_experts()
        entries = {}
        for name, shape in self.shapes.items():
            dtype = tensor_dtype(name, "BF16")
            if name.endswith(".weight_packed"):
                arr = q[name[: -len(".weight_packed")]][0]
            elif name.endswith(".weight_scale"):
                arr = q[name[: -len(".weight_scale")]][1]
            else:
                t = self.w(name[len(PREFIX) :]).detach().float().numpy()
                if name.endswith(".A_log"):  # one value per head, stored padded as the release does
                    t = np.concatenate([t, np.zeros(shape[0] - t.shape[0], np.float32)])
                arr = t.astype(ml_dtypes.bfloat16 if dtype == "BF16" else np.float32)
            assert arr.shape == shape, (name, arr.shape, shape)
            entries[name] = (dtype, shape, lambda arr=arr: arr)
        # two shards (trunk, then experts) with an index, as real checkpoints are sharded
        trunk = sum(int(np.prod(s)) * 2 for n, s in self.shapes.items() if ".experts." not in n)
        write_checkpoint(out, config, files, entries, shard_bytes=trunk + 1, desc="export", progress=False)


E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6])


def load_exported(path: Path) -> K3:
    """The training model holding the weights of an exported checkpoint (bf16 trunk in f32, MXFP4 experts
    decoded here from the spec's definition: E2M1 nibbles, low nibble first, times 2^(E8M0 - 127))."""
    from safetensors.torch import load_file

    config = json.loads((Path(path) / "config.json").read_text())
    t: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        t.update(load_file(f))
    model = K3(config, 0)
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in t.items():
        short = name[len(PREFIX) :]
        if name.endswith(".weight_scale"):
            continue
        if name.endswith(".weight_packed"):
            packed = tensor.to(torch.int64)
            scale = t[name.replace(".weight_packed", ".weight_scale")].to(torch.int64)
            vals = E2M1[torch.stack([packed & 15, packed >> 4], -1).reshape(packed.shape[0], -1)]
            w = vals * torch.pow(2.0, (scale - 127).float()).repeat_interleave(32, dim=1)
            layer, _, rest = short.partition(".experts.")
            e, proj = rest.split(".")[:2]
            experts.setdefault(f"{layer}.experts.{proj}", {})[int(e)] = w
            continue
        value = tensor.float()
        if short.endswith(".A_log"):
            value = value[: model.H]
        with torch.no_grad():
            model.w(short).copy_(value)
    with torch.no_grad():
        for key, per in experts.items():
            model.w(key).copy_(torch.stack([per[e] for e in range(len(per))]))
    return model


# ---- training ------------------------------------------------------------------------------------------------


def bits_per_byte(model: K3, corpus: Corpus, seq: int, n_windows: int, quantized: Any = None) -> float:
    """Held-out bits per byte over the first n_windows windows of seq+1 tokens (BOS targets excluded)."""
    data = corpus.held_out
    n_windows = min(n_windows, (len(data) - 1) // seq)
    nll = 0.0
    nbytes = 0
    with torch.no_grad():
        for i in range(0, n_windows, 8):
            rows = [data[j * seq : j * seq + seq + 1] for j in range(i, min(i + 8, n_windows))]
            ids = torch.from_numpy(np.stack(rows).astype(np.int64))
            logits = model(ids[:, :-1], quantized)
            tgt = ids[:, 1:]
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none")
            keep = tgt.reshape(-1) != corpus.bos
            nll += float(loss[keep].sum())
            nbytes += int(corpus.token_bytes[tgt.reshape(-1)[keep].numpy()].sum())
    return nll / math.log(2) / nbytes


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def build(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, str], Corpus]:
    t0 = time.time()
    tokens = list(training_tokens())
    config, _ = make_config("kimi_k3", DEMO, "bf16")
    tok_files, bos, eos = kimi_tokenizer(DEMO["vocab_size"], tokens)
    config.update(bos_token_id=bos, eos_token_id=eos, pad_token_id=DEMO["vocab_size"] - 1)
    corpus = Corpus(tokens, bos)
    log(
        args,
        {
            "event": "data",
            "train_files": corpus.n_files["train"],
            "held_out_files": corpus.n_files["held_out"],
            "train_tokens": len(corpus.train),
            "held_out_tokens": len(corpus.held_out),
            "seconds": round(time.time() - t0, 1),
        },
    )
    return config, tok_files, corpus


def log(args: argparse.Namespace, record: dict[str, Any]) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if args.out:
        with open(Path(args.out) / "log.jsonl", "a") as f:
            f.write(line + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="run directory (log.jsonl, ckpt.pt)")
    ap.add_argument("--steps", type=int, default=2400)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--stop-after", type=int, default=None, help="stop (resumable) after this many steps")
    ap.add_argument("--export", type=Path, default=None, help="write the K3 checkpoint from ckpt.pt and exit")
    ap.add_argument("--export-windows", type=int, default=10**9, help="held-out windows measured at export")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    config, tok_files, corpus = build(args)
    torch.manual_seed(args.seed)
    model = K3(config, args.seed)
    decay = [p for n, p in model.p.items() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.p.items() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    ckpt = args.out / "ckpt.pt"
    step = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
        log(args, {"event": "resume", "step": step, "steps": args.steps})
    if args.export:
        bpb = bits_per_byte(model, corpus, args.seq, args.export_windows)
        bpb_q = bits_per_byte(model, corpus, args.seq, args.export_windows, model.dequantized_experts())
        model.export(args.export, config, tok_files)
        log(args, {"event": "export", "step": step, "held_out_bpb": bpb, "held_out_bpb_mxfp4": bpb_q})
        return 0
    n_params = sum(p.numel() for p in model.parameters())
    if step == 0:
        log(args, {"event": "start", "params": n_params, "config": config["text_config"], **vars(args) | {"out": None}})
    t0 = time.time()
    tokens_done = 0
    stop = args.steps if args.stop_after is None else min(args.steps, step + args.stop_after)
    while step < stop:
        lr = lr_at(step, args.steps, args.lr, args.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        ids = corpus.batch(args.seed, step, args.batch, args.seq)
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        model.update_router_bias(1e-3)
        step += 1
        tokens_done += ids[:, :-1].numel()
        rec = {"step": step, "loss": round(float(loss.detach()), 5), "gnorm": round(gnorm, 4), "lr": lr}
        rec["tok_s"] = round(tokens_done / (time.time() - t0), 1)
        if step % args.eval_every == 0 or step == args.steps:
            rec["held_out_bpb"] = round(bits_per_byte(model, corpus, args.seq, args.eval_windows), 4)
        log(args, rec)
        if step % args.save_every == 0 or step == stop:
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, ckpt)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
