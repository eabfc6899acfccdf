"""Helpers shared by the convert.py tests (test_convert.py, test_convert_inputs.py): HF, a small DeepSeek-V3
config.json, and random_tensors, Hugging Face tensors of a config's shapes."""
import os

import numpy as np

import convert

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A small DeepSeek-V3 config.json: 2 dense layers, then 3 MoE layers; every width distinct, so that a
# transposed or misplaced block cannot pass.
HF = convert.HF_DEFAULTS | {"model_type": "deepseek_v3", "vocab_size": 300, "hidden_size": 24, "num_attention_heads": 3,
      "num_key_value_heads": 3, "num_hidden_layers": 5, "first_k_dense_replace": 2, "q_lora_rank": 20,
      "kv_lora_rank": 12, "qk_nope_head_dim": 10, "qk_rope_head_dim": 6, "v_head_dim": 7, "intermediate_size": 40,
      "moe_intermediate_size": 9, "n_routed_experts": 5, "num_experts_per_tok": 2, "n_shared_experts": 2,
      "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "hidden_act": "silu",
      "rms_norm_eps": 1e-6, "rope_interleave": True, "rope_parameters": {"rope_type": "default", "rope_theta": 5e4},
      "max_position_embeddings": 64, "tie_word_embeddings": False}


def random_tensors(hf, seed=0, fused_experts=False):
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape, np.float32)
            for name, shape in convert.hf_shapes(hf, fused_experts).items()}
