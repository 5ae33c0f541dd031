"""An independent PyTorch implementation of Kimi K3, written from ../shared/specs/kimi_k3.md alone (it
shares no code with the engine). `Variant` switches one invariant of the spec to a plausible wrong
reading, so the focused tests can show that each invariant changes the result."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file


@dataclass(frozen=True)
class Variant:
    bias_in_weights: bool = False  # wrong: the correction bias also enters the expert weights
    norm_per_expert: bool = False  # wrong: RMSNorm on each expert output instead of the aggregate
    situ_capped_sigmoid: bool = False  # wrong: sigmoid of the capped gate
    kda_gate_before_norm: bool = False  # wrong: sigmoid gate applied before the head norm
    mla_scale_nope_only: bool = False  # wrong: scale 1/sqrt(128) instead of 1/sqrt(192)
    mla_rotate_k_r: bool = False  # wrong: RoPE on k_r / q_rope (the model has none)
    ar_normed_sum: bool = False  # wrong: the residual sums the normalised sources
    a_log_per_channel: bool = False  # wrong: A_log indexed per channel (the first D values)


E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6])


class K3Reference:
    def __init__(self, path: Path, variant: Variant = Variant()):
        cfg = json.loads((path / "config.json").read_text())
        self.c = cfg["text_config"]
        self.v = variant
        self.t: dict[str, torch.Tensor] = {}
        for f in sorted(path.glob("*.safetensors")):
            self.t.update(load_file(f))
        self.eps = self.c["rms_norm_eps"]
        lac = self.c["linear_attn_config"]
        self.mla_layers = {i - 1 for i in lac["full_attn_layers"]}
        self._mx: dict[str, torch.Tensor] = {}

    def w(self, name: str) -> torch.Tensor:
        return self.t["language_model." + name].to(torch.float32)

    def mxfp4(self, name: str) -> torch.Tensor:
        if name not in self._mx:
            self._mx[name] = self._mxfp4(name)
        return self._mx[name]

    def _mxfp4(self, name: str) -> torch.Tensor:
        packed = self.t["language_model." + name + ".weight_packed"].to(torch.int64)
        scale = self.t["language_model." + name + ".weight_scale"].to(torch.int64)
        lo, hi = packed & 15, packed >> 4
        nib = torch.stack([lo, hi], -1).reshape(packed.shape[0], -1)
        vals = E2M1[nib]
        return vals * torch.pow(2.0, (scale - 127).to(torch.float32)).repeat_interleave(32, dim=1)

    # ---- pieces --------------------------------------------------------------------------------

    def rms(self, x: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + self.eps)

    def rmsnorm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.rms(x) * w

    def act(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        b1, b2 = self.c["activation_situ_beta"], self.c["activation_situ_linear_beta"]
        capped = b1 * torch.tanh(g / b1)
        sig = torch.sigmoid(capped if self.v.situ_capped_sigmoid else g)
        return capped * sig * (b2 * torch.tanh(u / b2))

    def mlp(self, x: torch.Tensor, p: str) -> torch.Tensor:
        return (
            self.act(x @ self.w(p + ".gate_proj.weight").T, x @ self.w(p + ".up_proj.weight").T)
            @ self.w(p + ".down_proj.weight").T
        )

    def ar(self, sources: list[torch.Tensor], p: str) -> torch.Tensor:
        f = self.w(p + "_norm.weight") * self.w(p + "_proj.weight")[0]
        s = torch.stack(sources)  # [n, T, E]
        normed = self.rms(s)
        prob = torch.softmax((normed * f).sum(-1), dim=0)  # [n, T]
        return ((normed if self.v.ar_normed_sum else s) * prob[..., None]).sum(0)

    def kda(self, x: torch.Tensor, p: str) -> torch.Tensor:
        lac = self.c["linear_attn_config"]
        H, D, K = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
        T = x.shape[0]

        def conv(name: str) -> torch.Tensor:
            y = x @ self.w(p + f".{name}_proj.weight").T  # [T, P]
            wt = self.w(p + f".{name}_conv1d.weight")[:, 0, :]  # [P, K]
            padded = torch.cat([torch.zeros(K - 1, y.shape[1]), y])
            out = sum(wt[:, j] * padded[j : j + T] for j in range(K))
            return torch.nn.functional.silu(out)

        q, k, v = conv("q").view(T, H, D), conv("k").view(T, H, D), conv("v").view(T, H, D)
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * D**-0.5
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        beta = torch.sigmoid(x @ self.w(p + ".b_proj.weight").T)  # [T, H]
        z = (x @ self.w(p + ".f_a_proj.weight").T) @ self.w(p + ".f_b_proj.weight").T + self.w(p + ".dt_bias")
        z = z.view(T, H, D)
        a_log = self.w(p + ".A_log").reshape(-1)
        a = a_log[:D].view(1, 1, D) if self.v.a_log_per_channel else a_log[:H].view(1, H, 1)
        g = lac["gate_lower_bound"] * torch.sigmoid(torch.exp(a) * z)
        alpha = torch.exp(g)
        S = torch.zeros(H, D, D)
        outs = []
        for t in range(T):
            S = alpha[t][:, :, None] * S
            u = torch.einsum("hkv,hk->hv", S, k[t])
            S = S + k[t][:, :, None] * (beta[t][:, None] * (v[t] - u))[:, None, :]
            outs.append(torch.einsum("hkv,hk->hv", S, q[t]))
        o = torch.stack(outs)  # [T, H, D]
        gate = torch.sigmoid(x @ self.w(p + ".g_proj.weight").T).view(T, H, D)
        if self.v.kda_gate_before_norm:
            o = self.rmsnorm(o * gate, self.w(p + ".o_norm.weight"))
        else:
            o = self.rmsnorm(o, self.w(p + ".o_norm.weight")) * gate
        return o.reshape(T, H * D) @ self.w(p + ".o_proj.weight").T

    def mla(self, x: torch.Tensor, p: str) -> torch.Tensor:
        H = self.c["num_attention_heads"]
        N, R, V, C = (self.c[k] for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank"))
        T = x.shape[0]
        q = self.rmsnorm(x @ self.w(p + ".q_a_proj.weight").T, self.w(p + ".q_a_layernorm.weight"))
        q = (q @ self.w(p + ".q_b_proj.weight").T).view(T, H, N + R)
        ckv = x @ self.w(p + ".kv_a_proj_with_mqa.weight").T
        c = self.rmsnorm(ckv[:, :C], self.w(p + ".kv_a_layernorm.weight"))
        k_r = ckv[:, C:]  # [T, R], shared by all heads
        q_nope, q_rope = q[..., :N], q[..., N:]
        if self.v.mla_rotate_k_r:
            pos = torch.arange(T, dtype=torch.float32)[:, None]
            inv = 1.0 / (10000 ** (torch.arange(0, R, 2, dtype=torch.float32) / R))
            cos, sin = torch.cos(pos * inv), torch.sin(pos * inv)

            def rot(z: torch.Tensor) -> torch.Tensor:
                z1, z2 = z[..., : R // 2], z[..., R // 2 :]
                cc, ss = (cos, sin) if z.dim() == 2 else (cos[:, None], sin[:, None])
                return torch.cat([z1 * cc - z2 * ss, z2 * cc + z1 * ss], -1)

            k_r, q_rope = rot(k_r), rot(q_rope)
        kv = (c @ self.w(p + ".kv_b_proj.weight").T).view(T, H, N + V)
        k_nope, v = kv[..., :N], kv[..., N:]
        scale = N**-0.5 if self.v.mla_scale_nope_only else (N + R) ** -0.5
        scores = (torch.einsum("thn,shn->hts", q_nope, k_nope) + torch.einsum("thr,sr->hts", q_rope, k_r)) * scale
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
        prob = torch.softmax(scores.masked_fill(mask, float("-inf")), -1)
        o = torch.einsum("hts,shv->thv", prob, v).reshape(T, H * V)
        o = o * torch.sigmoid(x @ self.w(p + ".g_proj.weight").T)
        return o @ self.w(p + ".o_proj.weight").T

    def moe(self, x: torch.Tensor, p: str) -> torch.Tensor:
        k = self.c["num_experts_per_token"]
        s = torch.sigmoid(x @ self.w(p + ".gate.weight").T)  # [T, n]
        bias = self.w(p + ".gate.e_score_correction_bias")
        sel = s + bias
        # top-k of the biased scores; ties go to the lower expert id (stable sort)
        idx = torch.sort(sel, dim=-1, descending=True, stable=True).indices[:, :k]
        weights = torch.gather(sel if self.v.bias_in_weights else s, 1, idx)
        if self.c["moe_renormalize"]:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights * self.c["routed_scaling_factor"]
        z = x @ self.w(p + ".routed_expert_down_proj.weight").T  # [T, L]
        acc = torch.zeros_like(z)
        for t in range(x.shape[0]):
            for j in range(k):
                e = int(idx[t, j])
                q = f"{p}.experts.{e}"
                h = self.act(z[t] @ self.mxfp4(q + ".w1").T, z[t] @ self.mxfp4(q + ".w3").T) @ self.mxfp4(q + ".w2").T
                if self.v.norm_per_expert:
                    h = self.rmsnorm(h, self.w(p + ".routed_expert_norm.weight"))
                acc[t] += weights[t, j] * h
        if not self.v.norm_per_expert:
            acc = self.rmsnorm(acc, self.w(p + ".routed_expert_norm.weight"))
        return acc @ self.w(p + ".routed_expert_up_proj.weight").T + self.mlp(x, p + ".shared_experts")

    # ---- the model -----------------------------------------------------------------------------

    @torch.no_grad()
    def logits(self, ids: list[int]) -> torch.Tensor:
        h = self.w("model.embed_tokens.weight")[torch.tensor(ids)]
        blocks: list[torch.Tensor] = []
        for layer in range(self.c["num_hidden_layers"]):
            p = f"model.layers.{layer}"
            prefix: torch.Tensor | None = h
            if blocks:
                h = self.ar([*blocks, h], p + ".self_attention_res")
            if layer % self.c["attn_res_block_size"] == 0:
                blocks.append(prefix)
                prefix = None
            x = self.rmsnorm(h, self.w(p + ".input_layernorm.weight"))
            a = self.mla(x, p + ".self_attn") if layer in self.mla_layers else self.kda(x, p + ".self_attn")
            prefix = a if prefix is None else prefix + a
            h = self.ar([*blocks, prefix], p + ".mlp_res")
            x = self.rmsnorm(h, self.w(p + ".post_attention_layernorm.weight"))
            if layer < self.c["first_k_dense_replace"]:
                m = self.mlp(x, p + ".mlp")
            else:
                m = self.moe(x, p + ".block_sparse_moe")
            h = prefix + m
        h = self.ar([*blocks, h], "model.output_attn_res")
        return self.rmsnorm(h, self.w("model.norm.weight")) @ self.w("lm_head.weight").T

    def generate(self, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
        seq, out, logits = list(prompt), [], []
        for _ in range(n):
            lg = self.logits(seq)[-1]
            logits.append(lg)
            tok = int(torch.argmax(lg))
            out.append(tok)
            seq.append(tok)
        return out, torch.stack(logits)
