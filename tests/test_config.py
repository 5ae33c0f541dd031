"""Typed specs from config.json: what is refused (with the key named) and what both config styles
(released checkpoints and transformers >= 5) mean."""

from __future__ import annotations

import pytest

from moestream import models
from moestream.errors import ConfigError
from moestream.synth import DEFAULTS


def cfg(arch: str, **changes) -> dict:
    d = {"model_type": arch, **DEFAULTS[arch], "bos_token_id": 1, "eos_token_id": 2}
    d.update(changes)
    return {k: v for k, v in d.items() if v is not ...}


@pytest.mark.parametrize(
    ("arch", "changes", "message"),
    [
        ("qwen3_moe", {"hidden_size": ...}, "missing required key hidden_size"),
        ("qwen3_moe", {"hidden_size": "128"}, "hidden_size must be int"),
        ("qwen3_moe", {"num_attention_heads": True}, "num_attention_heads must be an integer"),
        ("qwen3_moe", {"num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
        ("qwen3_moe", {"num_experts_per_tok": 17}, "exceeds"),
        ("qwen3_moe", {"rope_theta": ...}, "rope_theta"),
        ("qwen3_moe", {"hidden_act": "gelu"}, "hidden_act"),
        ("mixtral", {"vocab_size": 0}, "vocab_size must be positive"),
        ("mixtral", {"rope_scaling": {"rope_type": "longrope"}}, "unsupported rope type"),
        ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func"),
        ("deepseek_v3", {"topk_method": "greedy"}, "topk_method"),
        ("deepseek_v3", {"n_group": 3}, "not divisible by n_group"),
        ("deepseek_v3", {"topk_group": 5}, "topk_group"),
        ("deepseek_v3", {"kv_lora_rank": ...}, "kv_lora_rank"),
        ("deepseek_v3", {"rope_scaling": {"type": "yarn"}}, "factor"),
        ("qwen3_moe", {"rms_norm_eps": float("nan")}, "rms_norm_eps must be a finite number"),
        ("qwen3_moe", {"rms_norm_eps": float("inf")}, "rms_norm_eps must be a finite number"),
        ("qwen3_moe", {"rope_theta": "abc"}, "rope_theta must be float"),
        ("qwen3_moe", {"rope_theta": 10**400}, "rope_theta must be a finite number"),
        ("qwen3_moe", {"rope_theta": 1.0}, "rope_theta must be in"),
        ("qwen3_moe", {"num_hidden_layers": 10**9}, "num_hidden_layers is 1000000000, more than"),
        ("qwen3_moe", {"vocab_size": 10**8}, "vocab_size is 100000000, more than"),
        ("qwen3_moe", {"vocab_size": 10**400}, "vocab_size is out of range"),
        ("qwen3_moe", {"num_experts": 5000, "num_hidden_layers": 5000}, "routed experts moestream accepts"),
        ("qwen3_moe", {"head_dim": -8}, "head_dim must not be negative"),
        ("qwen3_moe", {"eos_token_id": [2, "x"]}, "eos_token_id must hold token ids"),
        ("qwen3_moe", {"mlp_only_layers": ["0"]}, "mlp_only_layers"),
        ("qwen3_moe", {"torch_dtype": 5}, "torch_dtype must be str"),
        ("mixtral", {"intermediate_size": 0}, "intermediate_size must be positive"),
        ("deepseek_v3", {"rope_scaling": {"type": "yarn", "factor": 4.0, "beta_slow": -1.0}}, "beta_slow"),
        ("deepseek_v3", {"rope_scaling": {"type": "yarn", "factor": 4.0, "mscale_all_dim": -20.0}}, "mscale"),
        ("deepseek_v3", {"routed_scaling_factor": float("nan")}, "routed_scaling_factor"),
        ("deepseek_v3", {"n_shared_experts": -1}, "n_shared_experts must not be negative"),
        ("kimi_linear", {"num_shared_experts": -1}, "num_shared_experts must not be negative"),
    ],
)
def test_refused(arch, changes, message):
    with pytest.raises(ConfigError, match=message):
        models.read_spec(cfg(arch, **changes))


def test_unknown_model_type():
    with pytest.raises(ConfigError, match="unknown model_type 'gpt2'"):
        models.read_spec({"model_type": "gpt2"})


def test_rope_scaling_and_rope_parameters_agree():
    """The released DeepSeek-V3 config (rope_theta + rope_scaling) and the transformers >= 5 form
    (rope_parameters) give the same spec."""
    yarn = {
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }
    old = models.read_spec(cfg("deepseek_v3", rope_theta=10000.0, rope_scaling={"type": "yarn", **yarn}))
    new = models.read_spec(
        cfg(
            "deepseek_v3",
            rope_theta=...,
            rope_scaling=...,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, **yarn},
        )
    )
    assert old == new
    assert old.rope.kind == "yarn" and old.rope.interleave  # DeepSeek rotates interleaved pairs


def test_kimi_k2_is_deepseek_v3():
    spec = models.read_spec(cfg("deepseek_v3", model_type="kimi_k2"))
    assert type(spec).__name__ == "DeepseekV3Spec" and spec.model_type == "kimi_k2"


def test_qwen3_moe_accepts_both_expert_count_keys():
    a = models.read_spec(cfg("qwen3_moe"))
    b = models.read_spec(cfg("qwen3_moe", num_experts=..., num_local_experts=DEFAULTS["qwen3_moe"]["num_experts"]))
    assert a == b


def test_k3_full_widths_with_fewer_layers():
    from moestream.synth import k3_full, make_config

    config, _ = make_config("kimi_k3", k3_full({"num_hidden_layers": 6, "num_experts": 64}), "bf16")
    spec = models.read_spec(config)
    assert spec.hidden_size == 7168 and spec.num_experts == 64 and spec.num_experts_per_token == 16
    assert spec.layer_types == ("kda", "kda", "kda", "mla", "kda", "mla")  # every fourth and the last
    full = models.read_spec(make_config("kimi_k3", k3_full({}), "bf16")[0])
    assert full.layer_types.count("mla") == 24 and full.layer_types[92] == "mla"


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v3", "kimi_linear", "kimi_k3"])
def test_synth_configs_name_their_architecture(arch):
    """Real configs carry `architectures` (llama.cpp's converter dispatches on it)."""
    from moestream.synth import make_config

    config, _ = make_config(arch, {}, "bf16")
    assert config["architectures"][0].endswith(("ForCausalLM", "ForConditionalGeneration"))
    models.read_spec(config)


def test_refused_not_an_object():
    with pytest.raises(ConfigError, match="not a JSON object"):
        models.read_spec([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize("changes", [{"activation_situ_beta": float("nan")}, {"num_hidden_layers": 10**9}])
def test_k3_refused(changes):
    from moestream.synth import make_config

    config, _ = make_config("kimi_k3", {}, "bf16")
    config["text_config"].update(changes)
    with pytest.raises(ConfigError, match=next(iter(changes)).removeprefix("activation_")):
        models.read_spec(config)
