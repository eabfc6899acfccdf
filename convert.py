"""Hugging Face DeepSeek-V3 export and import, with numpy and safetensors only (no torch).

    python convert.py to-hf RUN_DIR HF_DIR [--step N] [--max_shard_size 5GB]
    python convert.py from-hf HF_DIR RUN_DIR

to-hf writes a run's checkpoint (the newest, or step N) as a transformers `deepseek_v3` directory:
config.json, model.safetensors (model-0000i-of-0000n.safetensors and model.safetensors.index.json past
--max_shard_size), tokenizer.json and tokenizer_config.json (cl100k_base, encoding text as
data/tokenizer.py does, each special token at its id: data/hf_tokenizer.py). A model without a DeepSeek-V3
equivalent is refused with one line naming each differing flag. from-hf writes RUN_DIR (= OUTPUT_DIR/NAME)
holding a step-0 checkpoint with a fresh optimizer state, which `python main.py --output_dir OUTPUT_DIR
--name NAME` plus the flags it prints restores on any mesh and fine-tunes; a config.json field this model
cannot express is refused by name, a size past what it can be or past this machine's memory before anything
is allocated, a file that is not a regular file inside HF_DIR before it is opened (hf_files.py). Either
command writes its directory whole or not at all, and refuses a disk without room for it in one line.

The layouts (transformers' modeling_deepseek_v3, 5.24; torch Linear weights are [out, in], ours [in, out]
as x @ W, so every matrix is transposed):
- q_b_proj rows are per head [content K | rotary R] (our w_uq, w_qr); kv_a_proj_with_mqa rows are
  [KV latent | the one shared rotary key] (w_dkv, w_kr); kv_b_proj rows per head [key K | value V]
  (w_uk, w_uv); head-major on both sides.
- RoPE: with rope_interleave (DeepSeek-V3's checkpoints, and what to-hf writes) transformers rotates the
  channel pairs (2i, 2i+1) of the rotary query and key by position x base^(-2i/R); ours rotates (i, i + R/2)
  by the same frequency. The rotary columns are permuted (`rope_to_hf`): the same pairs, the same angles,
  the same products q.k. Without rope_interleave transformers rotates halves, as we do: no permutation.
- MoE: sigmoid scores in fp32; e_score_correction_bias (our routing bias) is added for the choice of the
  top-k only; the gates are the chosen scores, divided by their sum when norm_topk_prob
  (--renormalize_gates), times routed_scaling_factor (--routed_scaling); the shared experts are one MLP
  of n_shared_experts x moe_intermediate_size units, ours n_shared MLPs of that width (the same sum).
  Transformers drops no token: our run matches it with --capacity_factor 0.
- Experts are written one module each (mlp.experts.E.gate_proj.weight, ...), as DeepSeek-V3's own
  checkpoints and transformers' save_pretrained do; from-hf also reads the fused mlp.experts.gate_up_proj
  [E, 2F, D] (gate rows first) and mlp.experts.down_proj [E, D, F] that transformers holds in memory.
- The padded embedding rows (--vocab_size rounded up to 128) are not exported; from-hf pads with zeros.
"""
import argparse
import dataclasses
import math
import os
import sys
import uuid

import jax
import numpy as np
import orbax.checkpoint as ocp
import psutil

import sharding
import utils
from checkpoints import (SaveFailed, checkpoint_manager, checksums_and_finite, discard_failed_saves, quiet_failed_saves,
                         restore_step, save, wait_for_save)
from data.hf_tokenizer import tokenizer_files
from data.tokenizer import EOT_ID, VOCAB_SIZE
from hf_files import (ConvertError, check_room, fresh_dir, human, inside, json_text, parse_size, read_json,
                      read_safetensors, write_atomically, write_safetensors, write_text)
from model import NORM_EPS
from multihost import set_up_devices
from rundir import is_url
from trainer import build_trainer

# ----------------------------------------------------------------------------------------------------------
# The configs. DEEPSEEK_V3: each model flag whose value DeepSeek-V3's architecture fixes, and that value
# (the rest map to config.json fields, `hf_config` and `model_fields`).

DEEPSEEK_V3 = {"ffn": "gated_silu", "norm_shift": False, "latent_norm": True, "rope_all_layers": True,
               "layers_per_block": 1}


def flag_value(value):
    """A value as main.py's flags spell it."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def export_refusals(mc):
    """The flags of ModelConfig mc without a DeepSeek-V3 equivalent, each with the value that has one."""
    why = {"layers_per_block": " (dense layers come first instead: --first_k_dense)"}
    wrong = [f"--{name} {flag_value(getattr(mc, name))} (needs --{name} {flag_value(want)}{why.get(name, '')})"
             for name, want in DEEPSEEK_V3.items() if getattr(mc, name) != want]
    if mc.n_shared < 1:
        wrong.append(f"--n_shared {mc.n_shared} (needs --n_shared 1 or more: DeepSeek-V3's MoE layers always "
                     f"add shared experts)")
    return wrong


def hf_config(mc):
    """config.json for ModelConfig mc: every field transformers' DeepseekV3Config reads, plus DeepSeek's own
    routing fields (scoring_func, topk_method, moe_layer_freq) that other readers of the format (vLLM) go by."""
    eot = EOT_ID if EOT_ID < mc.vocab_size else None
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "dtype": "float32",
        "vocab_size": mc.vocab_size, "hidden_size": mc.model_dimension,
        "num_hidden_layers": mc.first_k_dense + mc.blocks, "first_k_dense_replace": mc.first_k_dense,
        "moe_layer_freq": 1, "intermediate_size": mc.ffn_dim, "moe_intermediate_size": mc.expert_dim,
        "num_attention_heads": mc.n_head, "num_key_value_heads": mc.n_head,
        "q_lora_rank": mc.q_latent_dim, "kv_lora_rank": mc.latent_dim,
        "qk_nope_head_dim": mc.head_dim, "qk_rope_head_dim": mc.dhR, "v_head_dim": mc.value_dim,
        "head_dim": mc.dhR, "qk_head_dim": mc.head_dim + mc.dhR,
        "n_routed_experts": mc.n_experts, "num_experts_per_tok": mc.k, "n_shared_experts": mc.n_shared,
        "n_group": 1, "topk_group": 1, "norm_topk_prob": mc.renormalize_gates,
        "routed_scaling_factor": mc.routed_scaling, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "hidden_act": "silu", "rms_norm_eps": NORM_EPS, "attention_bias": False, "attention_dropout": 0.0,
        "rope_interleave": True, "rope_parameters": {"rope_type": "default", "rope_theta": mc.rope_base},
        "max_position_embeddings": mc.T, "tie_word_embeddings": mc.tied_embeddings,
        "num_nextn_predict_layers": 0, "bos_token_id": eot, "eos_token_id": eot, "pad_token_id": None,
        "initializer_range": 0.02, "use_cache": True, "pretraining_tp": 1, "output_router_logits": False,
    }


# What transformers' DeepseekV3Config takes for each field it reads when config.json leaves it out
# (DeepSeek-V3's own sizes): a config.json is read as transformers reads it.
HF_DEFAULTS = {
    "vocab_size": 129_280, "hidden_size": 7168, "intermediate_size": 18_432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True, "hidden_act": "silu",
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_interleave": True,
    "attention_bias": False,
}


def read_hf_config(hf_dir):
    """hf_dir/config.json with transformers' defaults for the fields it leaves out."""
    config = read_json(inside(hf_dir, "config.json"))
    if not isinstance(config, dict):
        raise ConvertError(f"{hf_dir}/config.json holds no JSON object of fields")
    hf = HF_DEFAULTS | config
    if hf["num_key_value_heads"] is None:                      # DeepseekV3Config: None means one per head
        hf["num_key_value_heads"] = hf["num_attention_heads"]
    return hf


# config.json's sizes, each with its least value. The most: token ids, positions and expert indices are
# int32 here. A JSON true or 2.5 is no size (Python's True is an int: the type is checked exactly).
SIZES = dict.fromkeys(("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                       "num_attention_heads", "num_key_value_heads", "n_routed_experts", "num_experts_per_tok",
                       "n_group", "topk_group", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                       "qk_rope_head_dim", "v_head_dim", "max_position_embeddings"), 1) | {
    "first_k_dense_replace": 0, "n_shared_experts": 0}
MAX_SIZE = 2**31 - 1
# Host memory from-hf takes per parameter of the model it imports, at its peak: the tensors read, our fp32
# params, the fresh state (params and two Adam moments), the params put on the device, the checksums and the
# save. Measured 2026-12-03 with /usr/bin/time -v: peak RSS 2.56 GB importing 58.0M parameters, 0.65 GB
# importing 54K, so 34 bytes a parameter; rounded up.
IMPORT_BYTES_PER_PARAM = 36


def size_refusal(hf):
    """The first size of config.json `hf` that is no size this model can have, with its value; None if none."""
    for field, least in SIZES.items():
        value = hf[field]
        if value is None and field == "q_lora_rank":            # no query latent: import_refusals names it
            continue
        if type(value) is not int or not least <= value <= MAX_SIZE:
            return f"{field} {value!r} is not a size (needs an integer from {least} to {MAX_SIZE})"
    return None


def param_count(hf):
    """The parameters of config.json `hf`'s model, from the shapes of a two-layer model (one dense, one MoE)
    with one and with two experts: every count is linear in the layers and in the experts."""
    def counts(experts):
        shapes = hf_shapes(hf | {"num_hidden_layers": 2, "first_k_dense_replace": 1, "n_routed_experts": experts})
        return [sum(math.prod(shape) for name, shape in shapes.items() if name.startswith(prefix))
                for prefix in ("model.layers.0.", "model.layers.1.", "")]
    (dense, moe, total), (_, moe_two, _) = counts(1), counts(2)
    k, L, E = hf["first_k_dense_replace"], hf["num_hidden_layers"], hf["n_routed_experts"]
    return total - dense - moe + k * dense + (L - k) * (moe + (E - 1) * (moe_two - moe))


def check_memory(hf, where):
    """ConvertError when importing config.json `hf`'s model would take more memory than this machine has
    available: found before anything is allocated, not as the machine runs out."""
    n = param_count(hf)
    need, available = n * IMPORT_BYTES_PER_PARAM, psutil.virtual_memory().available
    if need > available:
        raise ConvertError(f"{where} describes a model of {n:,} parameters, which needs about {human(need)} of "
                           f"memory to import; this machine has {human(available)} available")


def _rope(hf):
    """(rope type, theta) from transformers 5's rope_parameters or 4's rope_theta and rope_scaling."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = params.get("rope_type") or params.get("type") or "default"
    return kind, float(params.get("rope_theta", hf.get("rope_theta", 10_000.0)))


def import_refusals(hf):
    """The fields of config.json `hf` (read_hf_config) this model has no equivalent for, each with its value."""
    kind, _ = _rope(hf)
    checks = [
        (hf.get("model_type") != "deepseek_v3", f"model_type {hf.get('model_type')!r} (needs 'deepseek_v3')"),
        ("quantization_config" in hf, "quantization_config (quantized weights: dequantize them first)"),
        (kind != "default", f"rope type {kind!r} (only the default RoPE: no yarn or other rope scaling)"),
        (hf["n_group"] != hf["topk_group"],
         f"n_group {hf['n_group']} with topk_group {hf['topk_group']} (group-limited routing; only topk_group = "
         f"n_group, which limits nothing)"),
        (hf.get("scoring_func", "sigmoid") != "sigmoid", f"scoring_func {hf.get('scoring_func')!r} (needs sigmoid)"),
        (hf["q_lora_rank"] is None, "q_lora_rank null (queries without a latent; needs a q_lora_rank)"),
        (hf["num_key_value_heads"] != hf["num_attention_heads"],
         f"num_key_value_heads {hf['num_key_value_heads']} (needs num_attention_heads, {hf['num_attention_heads']})"),
        (hf["attention_bias"], "attention_bias true (no biases here)"),
        (hf["hidden_act"] != "silu", f"hidden_act {hf['hidden_act']!r} (needs silu)"),
        (hf["rms_norm_eps"] != NORM_EPS, f"rms_norm_eps {hf['rms_norm_eps']} (needs {NORM_EPS})"),
        (hf.get("moe_layer_freq", 1) != 1, f"moe_layer_freq {hf.get('moe_layer_freq')} (needs 1)"),
        (hf["first_k_dense_replace"] >= hf["num_hidden_layers"],
         f"first_k_dense_replace {hf['first_k_dense_replace']} of num_hidden_layers {hf['num_hidden_layers']} "
         f"(needs at least one MoE layer)"),
        (hf["n_shared_experts"] < 1, f"n_shared_experts {hf['n_shared_experts']} (needs 1 or more)"),
    ]
    return [text for bad, text in checks if bad]


def model_fields(hf):
    """The ModelConfig fields of a DeepSeek-V3 config.json (dropless: transformers drops no token). A width
    that is its flag's derived default is left 0 (derived), as a run given no such flag records it."""
    _, theta = _rope(hf)
    D, H, K, F = hf["hidden_size"], hf["num_attention_heads"], hf["qk_nope_head_dim"], hf["intermediate_size"]
    derived = lambda value, default: 0 if value == default else value
    return dict(DEEPSEEK_V3, vocab_size=hf["vocab_size"], model_dimension=D, n_head=H,
                first_k_dense=hf["first_k_dense_replace"], blocks=hf["num_hidden_layers"] - hf["first_k_dense_replace"],
                T=hf["max_position_embeddings"], latent_dim=hf["kv_lora_rank"], q_latent_dim=hf["q_lora_rank"],
                dhR=hf["qk_rope_head_dim"], qk_head_dim=derived(K, D // H if D % H == 0 else None),
                v_head_dim=derived(hf["v_head_dim"], K), ffn_hidden_dim=derived(F, 4 * D),
                moe_hidden_dim=derived(hf["moe_intermediate_size"], F),
                n_experts=hf["n_routed_experts"], k=hf["num_experts_per_tok"], n_shared=hf["n_shared_experts"],
                routed_scaling=float(hf["routed_scaling_factor"]), renormalize_gates=bool(hf["norm_topk_prob"]),
                rope_base=theta, tied_embeddings=bool(hf["tie_word_embeddings"]), capacity_factor=0.0)


def model_config(hf):
    """The ModelConfig of config.json `hf`: model_fields, and what config.json does not hold (remat, dtype,
    balance loss, ...) as --preset dsv3-tiny has it."""
    return dataclasses.replace(utils.PRESETS["dsv3-tiny"].model, **model_fields(hf))


# ----------------------------------------------------------------------------------------------------------
# The tensors: our params (nested dict of numpy arrays, stacked layers) <-> transformers' names.

# Our leaf inside one layer -> its tensor inside model.layers.N.: transposed when a matrix, else copied.
LAYER_NAMES = {
    ("attn_norm", "scale"): "input_layernorm.weight",
    ("ffn_norm", "scale"): "post_attention_layernorm.weight",
    ("attn", "w_dq"): "self_attn.q_a_proj.weight",
    ("attn", "q_norm", "scale"): "self_attn.q_a_layernorm.weight",
    ("attn", "kv_norm", "scale"): "self_attn.kv_a_layernorm.weight",
    ("attn", "w_o"): "self_attn.o_proj.weight",
    ("ffn", "w_gate"): "mlp.gate_proj.weight",
    ("ffn", "w_up"): "mlp.up_proj.weight",
    ("ffn", "w_down"): "mlp.down_proj.weight",
    ("moe", "router"): "mlp.gate.weight",
}
# Tensors whose rows are our matrices' columns side by side, per head (per_head) or whole: (name, parts,
# per_head); the rotary parts (w_qr, w_kr) are permuted to transformers' interleaved pairs.
FUSED = (
    ("self_attn.q_b_proj.weight", ("w_uq", "w_qr"), True),
    ("self_attn.kv_a_proj_with_mqa.weight", ("w_dkv", "w_kr"), False),
    ("self_attn.kv_b_proj.weight", ("w_uk", "w_uv"), True),
)
ROTARY = ("w_qr", "w_kr")
EXPERTS = (("expert_gate", "gate_proj"), ("expert_up", "up_proj"), ("expert_down", "down_proj"))
SHARED = (("shared_gate", "gate_proj"), ("shared_up", "up_proj"), ("shared_down", "down_proj"))


def rope_to_hf(R):
    """Column order of a rotary block for transformers' interleaved RoPE: theirs[2i] = ours[i] and
    theirs[2i + 1] = ours[i + R/2], the pair (i, i + R/2) that we rotate by base^(-i/(R/2))."""
    return np.stack([np.arange(R // 2), np.arange(R // 2) + R // 2], axis=1).reshape(-1)


def _leaf(tree, path):
    """tree[path[0]][path[1]]...; None where the path is not in the tree."""
    for key in path:
        tree = tree.get(key) if isinstance(tree, dict) else None
    return tree


def layer_to_hf(layer, H):
    """{name inside model.layers.N.: array} of one layer of our params (a nested dict of numpy arrays,
    an MoE layer's router_bias beside its router), H heads."""
    out = {name: _leaf(layer, path).T for path, name in LAYER_NAMES.items() if _leaf(layer, path) is not None}
    attn = layer["attn"]
    R = attn["w_kr"].shape[-1]
    for name, parts, per_head in FUSED:
        blocks = []
        for part in parts:
            w = attn[part].reshape(attn[part].shape[0], H, -1) if per_head else attn[part][:, None, :]
            blocks.append(w[..., rope_to_hf(R)] if part in ROTARY else w)
        fused = np.concatenate(blocks, axis=-1)
        out[name] = fused.reshape(fused.shape[0], -1).T
    if "moe" in layer:
        moe = layer["moe"]
        out["mlp.gate.e_score_correction_bias"] = moe["router_bias"]
        for ours, theirs in EXPERTS:
            out |= {f"mlp.experts.{e}.{theirs}.weight": w.T for e, w in enumerate(moe[ours])}
        n, D, F = moe["shared_gate"].shape
        for ours, theirs in SHARED:
            w = moe[ours]   # [n, D, F] up, [n, F, D] down: one MLP of n F units, expert s's units s F + j
            w = np.moveaxis(w, 0, 1).reshape(D, n * F) if theirs != "down_proj" else w.reshape(n * F, D)
            out[f"mlp.shared_experts.{theirs}.weight"] = w.T
    return out


def layer_from_hf(get, hf, moe):
    """One layer of our params from get(name inside model.layers.N.) -> array (fp32 numpy)."""
    H, K, R, V = hf["num_attention_heads"], hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"]
    interleave = hf["rope_interleave"]
    layer = {}
    other_ffn = "ffn" if moe else "moe"
    for path, name in LAYER_NAMES.items():
        if path[0] == other_ffn:
            continue
        node = layer
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = np.ascontiguousarray(get(name).T)
    widths = {"w_uq": K, "w_qr": R, "w_dkv": hf["kv_lora_rank"], "w_kr": R, "w_uk": K, "w_uv": V}
    for name, parts, per_head in FUSED:
        w = get(name).T
        w = w.reshape(w.shape[0], H if per_head else 1, -1)
        for part, piece in zip(parts, np.split(w, np.cumsum([widths[p] for p in parts])[:-1], axis=-1)):
            if part in ROTARY and interleave:
                piece = piece[..., np.argsort(rope_to_hf(R))]
            layer["attn"][part] = np.ascontiguousarray(piece.reshape(w.shape[0], -1))
    if moe:
        E, F = hf["n_routed_experts"], hf["moe_intermediate_size"]
        layer["moe"]["router_bias"] = get("mlp.gate.e_score_correction_bias")
        layer["moe"].update(_experts(get, E, F))
        n = hf["n_shared_experts"]
        for ours, theirs in SHARED:
            w = get(f"mlp.shared_experts.{theirs}.weight").T       # [D, n F] or [n F, D]
            w = np.moveaxis(w.reshape(w.shape[0], n, F), 1, 0) if theirs != "down_proj" else w.reshape(n, F, -1)
            layer["moe"][ours] = np.ascontiguousarray(w)
    return layer


def _experts(get, E, F):
    """expert_gate, expert_up [E, D, F] and expert_down [E, F, D] from one module per expert or from
    transformers' fused gate_up_proj [E, 2F, D] (gate rows first) and down_proj [E, D, F]."""
    fused = get("mlp.experts.gate_up_proj", optional=True)
    if fused is not None:
        gate_up = fused.transpose(0, 2, 1)
        down = get("mlp.experts.down_proj").transpose(0, 2, 1)
        return {"expert_gate": np.ascontiguousarray(gate_up[..., :F]),
                "expert_up": np.ascontiguousarray(gate_up[..., F:]), "expert_down": np.ascontiguousarray(down)}
    return {ours: np.stack([get(f"mlp.experts.{e}.{theirs}.weight").T for e in range(E)]) for ours, theirs in EXPERTS}


def params_to_hf(params, router_bias, mc):
    """{transformers name: fp32 array} of our params (model order, numpy) and routing bias [blocks, E]."""
    V, H = mc.vocab_size, mc.n_head
    out = {"model.embed_tokens.weight": params["embed"][:V]}
    layers = [layer_of(params["prologue"], i) for i in range(mc.first_k_dense)] if mc.first_k_dense else []
    moe = params["blocks"]["moe"]
    for b in range(mc.blocks):
        layer = layer_of(moe, b)
        layer["moe"] = layer["moe"] | {"router_bias": router_bias[b]}
        layers.append(layer)
    for i, layer in enumerate(layers):
        out |= {f"model.layers.{i}.{name}": w for name, w in layer_to_hf(layer, H).items()}
    out["model.norm.weight"] = params["final_norm"]["scale"]
    if not mc.tied_embeddings:
        out["lm_head.weight"] = params["unembed"][:V]
    return {name: np.ascontiguousarray(w, np.float32) for name, w in out.items()}


def layer_of(stacked, i):
    """Layer i of a tree of stacked arrays."""
    return {k: layer_of(v, i) if isinstance(v, dict) else v[i] for k, v in stacked.items()}


def hf_shapes(hf, fused_experts=False):
    """{transformers name: shape} of the model config.json `hf` describes, its experts one module each or
    (fused_experts) as transformers holds them in memory."""
    D, H, V, L, k = (hf[f] for f in ("hidden_size", "num_attention_heads", "vocab_size", "num_hidden_layers",
                                      "first_k_dense_replace"))
    K, R, Vh, Lq, Lkv = (hf[f] for f in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "q_lora_rank",
                                          "kv_lora_rank"))
    F, Fm, E, n = (hf[f] for f in ("intermediate_size", "moe_intermediate_size", "n_routed_experts",
                                   "n_shared_experts"))
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not hf["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (V, D)
    for i in range(L):
        layer = {"input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,),
                 "self_attn.q_a_proj.weight": (Lq, D), "self_attn.q_a_layernorm.weight": (Lq,),
                 "self_attn.q_b_proj.weight": (H * (K + R), Lq), "self_attn.kv_a_proj_with_mqa.weight": (Lkv + R, D),
                 "self_attn.kv_a_layernorm.weight": (Lkv,), "self_attn.kv_b_proj.weight": (H * (K + Vh), Lkv),
                 "self_attn.o_proj.weight": (D, H * Vh)}
        if i < k:
            layer |= {"mlp.gate_proj.weight": (F, D), "mlp.up_proj.weight": (F, D), "mlp.down_proj.weight": (D, F)}
        else:
            layer |= {"mlp.gate.weight": (E, D), "mlp.gate.e_score_correction_bias": (E,),
                      "mlp.shared_experts.gate_proj.weight": (n * Fm, D),
                      "mlp.shared_experts.up_proj.weight": (n * Fm, D), "mlp.shared_experts.down_proj.weight": (D, n * Fm)}
            layer |= ({"mlp.experts.gate_up_proj": (E, 2 * Fm, D), "mlp.experts.down_proj": (E, D, Fm)} if fused_experts
                      else {f"mlp.experts.{e}.{name}.weight": shape for e in range(E)
                            for name, shape in (("gate_proj", (Fm, D)), ("up_proj", (Fm, D)), ("down_proj", (D, Fm)))})
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
    return shapes


def params_from_hf(tensors, hf, padded_vocab):
    """(our params in model order, routing bias [blocks, E]) from {transformers name: array}: consumes the
    names it uses from `tensors`; ConvertError naming a missing one or one whose shape is not config.json's."""
    shapes = hf_shapes(hf) | hf_shapes(hf, fused_experts=True)

    def getter(prefix):
        def get(name, optional=False):
            full = prefix + name
            if full not in tensors:
                if optional:
                    return None
                raise ConvertError(f"tensor {full} is missing (config.json's model has it)")
            if tuple(tensors[full].shape) != shapes[full]:
                raise ConvertError(f"tensor {full} has shape {tuple(tensors[full].shape)}; config.json's model "
                                   f"gives it {shapes[full]}")
            return np.asarray(tensors.pop(full), np.float32)
        return get

    def padded(w):
        return np.concatenate([w, np.zeros((padded_vocab - w.shape[0], w.shape[1]), np.float32)])

    def stack(trees):
        return {key: stack([t[key] for t in trees]) if isinstance(trees[0][key], dict)
                else np.stack([t[key] for t in trees]) for key in trees[0]}

    top = getter("")
    k, L = hf["first_k_dense_replace"], hf["num_hidden_layers"]
    layers = [layer_from_hf(getter(f"model.layers.{i}."), hf, moe=i >= k) for i in range(L)]
    moe = stack(layers[k:])
    router_bias = moe["moe"].pop("router_bias")
    params = {"embed": padded(top("model.embed_tokens.weight")), "blocks": {"moe": moe},
              "final_norm": {"scale": top("model.norm.weight")}}
    if k:
        params["prologue"] = stack(layers[:k])
    if not hf["tie_word_embeddings"]:
        params["unembed"] = padded(top("lm_head.weight"))
    return params, router_bias


# ----------------------------------------------------------------------------------------------------------
# The two commands.


def _model_config(meta, where):
    fields = {f.name for f in dataclasses.fields(utils.ModelConfig)}
    saved = meta.get("model") or {}
    if not saved:
        raise ConvertError(f"{where} records no model config (a checkpoint from before configs were saved)")
    return utils.ModelConfig(**{k: v for k, v in saved.items() if k in fields})


def read_checkpoint(run_dir, step=None, check=lambda mc, where: None):
    """(ModelConfig, params in model order and routing bias [blocks, E] as numpy, where) of checkpoint
    `step` (None: the newest) of run_dir, restored on one device whatever mesh and layout saved it.
    check(mc, where) runs on the recorded config before any array is read."""
    if not is_url(run_dir) and not os.path.isdir(os.path.join(run_dir, "checkpoints")):
        raise ConvertError(f"RUN_DIR {run_dir} holds no checkpoints directory; give a run's OUTPUT_DIR/NAME")
    mngr = checkpoint_manager(run_dir, read_only=True)
    steps = sorted(mngr.all_steps())
    if not steps or (step is not None and step not in steps):
        raise ConvertError(f"--step {step}: {mngr.directory} holds steps {', '.join(map(str, steps))}" if steps
                           else f"RUN_DIR {run_dir} holds no checkpoint (in {mngr.directory})")
    step = steps[-1] if step is None else step
    where = f"{mngr.directory}/{step}"
    mc = _model_config(mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"], where)
    check(mc, where)
    # Read in model order (pipeline_repeats 1) on one device, whatever layout and mesh saved it.
    cfg = utils.Config(model=dataclasses.replace(mc, pipeline_repeats=1))
    trainer = build_trainer(cfg, sharding.make_mesh((1, 1, 1), jax.devices()[:1]))
    state, _ = restore_step(mngr, step, trainer.abstract_state, 1)
    mngr.close()
    params, bias = jax.device_get((state["params"], state["router_bias"]))
    return mc, params, bias, where


def _exportable(mc, where):
    wrong = export_refusals(mc)
    if wrong:
        presets = " or ".join(f"--preset {name}" for name, cfg in utils.PRESETS.items() if not export_refusals(cfg.model))
        raise ConvertError(f"{where} holds a model with no DeepSeek-V3 equivalent: {'; '.join(wrong)}; python main.py "
                           f"{presets} trains one that exports, as does this model with those flags")


def to_hf(run_dir, hf_dir, step=None, max_shard_bytes=5 * 10**9, say=print):
    """Export checkpoint `step` (newest: None) of run_dir into hf_dir. Returns the files written."""
    fresh_dir(hf_dir, "HF_DIR")
    mc, params, bias, where = read_checkpoint(run_dir, step, _exportable)
    if mc.capacity_factor:
        say(f"note: the run drops tokens over --capacity_factor {mc.capacity_factor}; transformers drops none, as "
            f"this model does with --capacity_factor 0")
    tensors = params_to_hf(params, bias, mc)
    config = hf_config(mc)
    tokenizer = tokenizer_files(mc.T) if mc.vocab_size == VOCAB_SIZE else {}
    if not tokenizer:
        say(f"note: no tokenizer files: --vocab_size {mc.vocab_size} is not cl100k_base's {VOCAB_SIZE}")

    texts = {name: json_text(value) for name, value in {"config.json": config, **tokenizer}.items()}
    # the safetensors headers and the index: well under 512 bytes a tensor
    need = sum(w.nbytes + 512 for w in tensors.values()) + sum(len(text.encode()) for text in texts.values())

    def fill(tmp):
        files = write_safetensors(tmp, tensors, max_shard_bytes)
        for name, text in texts.items():
            write_text(os.path.join(tmp, name), text)
        return files + list(texts)
    files = write_atomically(hf_dir, "HF_DIR", need, fill)
    say(f"wrote {hf_dir} from {where}: {len(tensors)} tensors, "
        f"{sum(w.size for w in tensors.values()):,} parameters, {', '.join(files)}")
    return files


def from_hf(hf_dir, run_dir, say=print):
    """Import the deepseek_v3 directory hf_dir as a run directory run_dir with a step-0 checkpoint. Returns
    the ModelConfig and the main.py flags that restore it."""
    fresh_dir(run_dir, "RUN_DIR")
    hf = read_hf_config(hf_dir)
    wrong = size_refusal(hf)
    if wrong:
        raise ConvertError(f"{hf_dir}/config.json: {wrong}")
    wrong = import_refusals(hf)
    if wrong:
        raise ConvertError(f"{hf_dir}/config.json has no equivalent here: {'; '.join(wrong)}")
    check_memory(hf, f"{hf_dir}/config.json")
    mc = model_config(hf)
    cfg = utils.Config(model=mc)
    try:                # the model's rules alone: the samples' length is the fine-tune's to set
        utils.validate(dataclasses.replace(cfg, inference=utils.InferenceConfig(max_tokens=0)), 1)
    except utils.ConfigError as e:
        raise ConvertError(f"{hf_dir}/config.json gives an invalid model here: "
                           + "; ".join(line.strip().removeprefix("- ") for line in str(e).splitlines()[1:])) from None
    trainer = build_trainer(cfg, sharding.make_mesh((1, 1, 1), jax.devices()[:1]))
    # the checkpoint: params and optimizer state, uncompressed (as checkpoints.save counts it)
    need = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(trainer.abstract_state))
    check_room(run_dir, "RUN_DIR", need)
    tensors = read_safetensors(hf_dir)
    params, bias = params_from_hf(tensors, hf, mc.padded_vocab)
    # transformers' model ignores the multi-token-prediction modules past num_hidden_layers: so do we
    mtp = [n for n in tensors if n.startswith("model.layers.") and int(n.split(".")[2]) >= hf["num_hidden_layers"]]
    unused = sorted(set(tensors) - set(mtp))
    if unused:
        raise ConvertError(f"{hf_dir} holds tensors config.json has no place for: {', '.join(unused[:3])}"
                           + (f" (and {len(unused) - 3} more)" if len(unused) > 3 else ""))
    if mtp:
        say(f"note: {len(mtp)} multi-token-prediction tensors (layers from {hf['num_hidden_layers']} on) are not "
            f"imported; transformers' DeepseekV3ForCausalLM does not use them either")
    # the model's own parameters, for the names and shapes the mapping gave
    shapes = lambda tree: {jax.tree_util.keystr(path): tuple(w.shape)
                           for path, w in jax.tree_util.tree_leaves_with_path(tree)}
    want, have = shapes(jax.eval_shape(lambda key: sharding.init_params(mc, key), jax.random.key(0))), shapes(params)
    wrong = sorted(name for name in set(want) | set(have) if want.get(name) != have.get(name))
    if wrong:
        raise ConvertError(f"{hf_dir}: parameter {wrong[0]} comes out as {have.get(wrong[0])}, the model here has "
                           f"{want.get(wrong[0])} ({len(wrong)} differ)")
    fresh = trainer.fresh_state(cfg.run.seed)
    state = fresh | jax.device_put({"params": params, "router_bias": bias},
                                   {"params": jax.tree.map(lambda a: a.sharding, fresh["params"]),
                                    "router_bias": fresh["router_bias"].sharding})

    def fill(tmp):
        mngr = checkpoint_manager(tmp)
        sums, _ = jax.device_get(checksums_and_finite(state))
        meta = {"step": 0, "sequences": 0, "run_id": uuid.uuid4().hex[:8], "model": dataclasses.asdict(mc),
                "val_loss": None, "checksums": {path: int(value) for path, value in sums.items()}}
        try:
            save(mngr, 0, state, meta)
            wait_for_save(mngr)
        except SaveFailed:          # a full disk: Orbax's writer threads closed, as main.py does
            discard_failed_saves(mngr)
            raise
        mngr.close()
    write_atomically(run_dir, "RUN_DIR", need, fill)
    flags = main_flags(mc)
    output_dir, name = os.path.split(os.path.abspath(run_dir))
    say(f"wrote {run_dir}: a step-0 checkpoint (fresh optimizer state) of {hf_dir}'s model, "
        f"{sum(w.size for w in jax.tree.leaves(params)):,} parameters; fine-tune it with\n"
        f"  python main.py --output_dir {output_dir} --name {name} {' '.join(flags)}")
    return mc, flags


def main_flags(mc):
    """The main.py flags that give ModelConfig mc: --preset dsv3-tiny and each model field it differs in."""
    base = utils.PRESETS["dsv3-tiny"].model
    return ["--preset", "dsv3-tiny"] + [
        part for f in dataclasses.fields(mc) if getattr(mc, f.name) != getattr(base, f.name)
        for part in (f"--{f.name}", flag_value(getattr(mc, f.name)))]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="convert.py", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    out = commands.add_parser("to-hf", help="a run's checkpoint -> a transformers deepseek_v3 directory")
    out.add_argument("run_dir", metavar="RUN_DIR", help="OUTPUT_DIR/NAME of the run")
    out.add_argument("hf_dir", metavar="HF_DIR", help="the new directory to write (missing or empty)")
    out.add_argument("--step", type=int, help="the checkpoint's step (default: the newest)")
    out.add_argument("--max_shard_size", default="5GB",
                     help="safetensors files of at most this size, with an index past one (default 5GB)")
    back = commands.add_parser("from-hf", help="a transformers deepseek_v3 directory -> a run main.py fine-tunes")
    back.add_argument("hf_dir", metavar="HF_DIR", help="a directory with config.json and safetensors weights")
    back.add_argument("run_dir", metavar="RUN_DIR", help="the new run directory, OUTPUT_DIR/NAME (missing or empty)")
    args = parser.parse_args(argv)
    set_up_devices(utils.Config())          # as main.py does first: the CPU, quietly, off a TPU VM with libtpu
    quiet_failed_saves()
    try:
        if args.command == "to-hf":
            to_hf(args.run_dir, args.hf_dir, args.step, parse_size(args.max_shard_size))
        else:
            from_hf(args.hf_dir, args.run_dir)
    except ConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
