"""Turning checkpoint tensors into kernel weights, with every shape checked against the config."""

from __future__ import annotations

import numpy as np

from ..config import ModelSpec
from ..errors import CheckpointError
from ..formats.checkpoint import Checkpoint
from ..quant import Weight
from ..quant.formats import fp8_scale_shape
from .base import FFN, Attention, Block, Decoder, DenseMLP, Expert, Linear, MLAttention, Rope


class Tensors:
    """Named access to a checkpoint's tensors; `rename` maps our names to the checkpoint's."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt

    def has(self, name: str) -> bool:
        return self.ckpt.has(name)

    def packed(self, name: str, rows: int, cols: int) -> Weight | None:
        """The matrix as a packed store requantized it, if it did."""
        get = getattr(self.ckpt, "matrix", None)
        return get(name, rows, cols) if get is not None else None

    def weight(self, name: str, rows: int, cols: int) -> Weight:
        """A [rows, cols] matrix in its stored format (fp8 with its weight_scale_inv block scales)."""
        packed = self.packed(name, rows, cols)
        if packed is not None:
            return packed
        arr = self.ckpt.array(name, (rows, cols))
        return self._weight(name, arr)

    def _weight(self, name: str, arr: np.ndarray, scales: np.ndarray | None = None) -> Weight:
        info = self.ckpt.info(name)
        if info.dtype == "F8_E4M3" and scales is None:
            sname = name.removesuffix("weight") + "weight_scale_inv"
            scales = self.ckpt.array(sname, fp8_scale_shape(arr.shape[0], arr.shape[1]))
            if scales.dtype != np.float32:
                scales = scales.astype(np.float32)
        try:
            return Weight(arr, scales)
        except ValueError as e:
            raise CheckpointError(f"{self.ckpt.path}: tensor {name}: {e}") from None

    def mxfp4(self, prefix: str, rows: int, cols: int) -> Weight:
        """compressed-tensors mxfp4-pack-quantized: {prefix}.weight_packed uint8 [rows, cols/2] and
        {prefix}.weight_scale uint8 [rows, cols/32] (E8M0; 255 is NaN and refused)."""
        packed_w = self.packed(prefix, rows, cols)
        if packed_w is not None:
            return packed_w
        if cols % 32:
            raise CheckpointError(f"{self.ckpt.path}: {prefix}: mxfp4 needs a width divisible by 32, got {cols}")
        packed = self.ckpt.array(f"{prefix}.weight_packed", (rows, cols // 2))
        scale = self.ckpt.array(f"{prefix}.weight_scale", (rows, cols // 32))
        for name, arr in ((f"{prefix}.weight_packed", packed), (f"{prefix}.weight_scale", scale)):
            if arr.dtype != np.uint8:
                raise CheckpointError(f"{self.ckpt.path}: tensor {name} is {arr.dtype}, mxfp4 stores uint8")
        path = self.ckpt.path

        def check(w: Weight) -> None:
            if np.any(w.scales == 255):
                raise CheckpointError(
                    f"{path}: tensor {prefix}.weight_scale has an E8M0 scale of 255 (NaN in the OCP spec)"
                )

        w = Weight(packed, scale, fmt="mxfp4")
        # Scales are 1/17 of an expert: read them now when the checkpoint is preloaded anyway, else
        # when the expert is first used (a whole K3 has 85 GB of them).
        if getattr(self.ckpt, "preload", False):
            check(w)
        else:
            w.validate_lazily(check)
        return w

    def vector(self, name: str, n: int) -> np.ndarray:
        return np.asarray(self.ckpt.array(name, (n,)), dtype=np.float32)

    def optional_vector(self, name: str, n: int) -> np.ndarray | None:
        return self.vector(name, n) if self.has(name) else None

    def experts(
        self,
        prefixes: list[str],
        per_expert: tuple[str, str, str],
        n: int,
        hidden: int,
        inter: int,
    ) -> list[Expert]:
        """Routed experts under the first prefix that has them, either one tensor per expert
        ({prefix}.{e}.{gate|up|down}.weight) or stacked ({prefix}.gate_up_proj [n, 2I, E] and
        {prefix}.down_proj [n, E, I])."""
        g, u, d = per_expert
        for p in prefixes:
            if self.has(f"{p}.0.{g}.weight"):
                return [
                    Expert(
                        self.weight(f"{p}.{e}.{g}.weight", inter, hidden),
                        self.weight(f"{p}.{e}.{u}.weight", inter, hidden),
                        self.weight(f"{p}.{e}.{d}.weight", hidden, inter),
                    )
                    for e in range(n)
                ]
            if self.has(f"{p}.gate_up_proj"):
                gu = self.ckpt.array(f"{p}.gate_up_proj", (n, 2 * inter, hidden))
                dn = self.ckpt.array(f"{p}.down_proj", (n, hidden, inter))
                return [
                    Expert(
                        self._weight(f"{p}.gate_up_proj", gu[e, :inter]),
                        self._weight(f"{p}.gate_up_proj", gu[e, inter:]),
                        self._weight(f"{p}.down_proj", dn[e]),
                    )
                    for e in range(n)
                ]
        raise CheckpointError(f"{self.ckpt.path}: missing tensor {prefixes[0]}.0.{g}.weight (routed experts)")

    def dense_mlp(self, prefix: str, inter: int, hidden: int) -> DenseMLP:
        """{prefix}.gate_proj / up_proj [inter, hidden] and down_proj [hidden, inter]."""
        return DenseMLP(
            self.weight(f"{prefix}.gate_proj.weight", inter, hidden),
            self.weight(f"{prefix}.up_proj.weight", inter, hidden),
            self.weight(f"{prefix}.down_proj.weight", hidden, inter),
        )

    def block(self, prefix: str, attn: Attention, ffn: FFN, spec: ModelSpec) -> Block:
        """A pre-norm decoder layer with {prefix}.input_layernorm and post_attention_layernorm."""
        E = spec.hidden_size
        return Block(
            self.vector(f"{prefix}.input_layernorm.weight", E),
            attn,
            self.vector(f"{prefix}.post_attention_layernorm.weight", E),
            ffn,
            spec.rms_norm_eps,
        )

    def decoder(self, blocks: list[Block], spec: ModelSpec) -> Decoder:
        """model.embed_tokens, model.norm and lm_head (or the embedding, when tied) around the blocks."""
        E, V = spec.hidden_size, spec.vocab_size
        embed = self.weight("model.embed_tokens.weight", V, E)
        head = embed if spec.tie_word_embeddings else self.weight("lm_head.weight", V, E)
        return Decoder(embed, blocks, self.vector("model.norm.weight", E), head, spec.rms_norm_eps, V)

    def mla(
        self,
        a: str,
        E: int,
        H: int,
        nope: int,
        rope_dim: int,
        v_dim: int,
        kv_lora_rank: int,
        q_lora_rank: int | None,
        rope: Rope | None,
        scaling: float,
        norm_eps: float,
        bias: bool = False,
        out_gate: bool = False,
    ) -> MLAttention:
        """Multi-head latent attention under {a} (self_attn): q_proj, or q_a_proj + q_a_layernorm + q_b_proj;
        kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj; with out_gate, g_proj (Kimi K3). bias adds
        the biases DeepSeek's attention_bias puts on q_a, kv_a and o."""
        N, R, V, C, Q = nope, rope_dim, v_dim, kv_lora_rank, q_lora_rank

        def lin(name: str, rows: int, cols: int, with_bias: bool = False) -> Linear:
            b = self.vector(f"{name}.bias", rows) if with_bias else None
            return Linear(self.weight(f"{name}.weight", rows, cols), b)

        return MLAttention(
            q_proj=lin(f"{a}.q_proj", H * (N + R), E) if Q is None else None,
            q_a_proj=lin(f"{a}.q_a_proj", Q, E, bias) if Q is not None else None,
            q_a_norm=self.vector(f"{a}.q_a_layernorm.weight", Q) if Q is not None else None,
            q_b_proj=lin(f"{a}.q_b_proj", H * (N + R), Q) if Q is not None else None,
            kv_a_proj=lin(f"{a}.kv_a_proj_with_mqa", C + R, E, bias),
            kv_a_norm=self.vector(f"{a}.kv_a_layernorm.weight", C),
            kv_b_proj=lin(f"{a}.kv_b_proj", H * (N + V), C),
            o_proj=lin(f"{a}.o_proj", E, H * V, bias),
            heads=H,
            nope_dim=N,
            rope_dim=R,
            v_dim=V,
            kv_lora_rank=C,
            rope=rope,
            scaling=scaling,
            norm_eps=norm_eps,
            out_gate=lin(f"{a}.g_proj", H * V, E) if out_gate else None,
        )
