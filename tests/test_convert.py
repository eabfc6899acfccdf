"""convert.py: the Hugging Face DeepSeek-V3 export and import. The mapping between our params and
transformers' tensors (both ways, bitwise, the rotary permutation against transformers' interleaved
rotation), the safetensors files (one, or shards with an index), the tokenizer files (their merges
rebuild tiktoken's encoding; each special token at its id in tokenizers and transformers' AutoTokenizer,
which requirements.txt installs without torch), the configs and their refusals, and the two commands end
to end. Hostile Hugging Face directories: test_convert_inputs.py. The rest of the comparison with
transformers is opt-in (JAXFORMER_SLOW_TESTS=1): AutoTokenizer on the whole bundled corpus, and, with a
virtualenv from requirements-hf.txt (torch), scripts/verification_card.py's checks in .venv-hf.
"""
import gzip
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import regex

import convert
from convert_util import HF, ROOT, random_tensors
from data import hf_tokenizer
import hf_files
from ceiling import CEILING_S
from run_util import mount, unoptimized

HF_PYTHON = os.path.join(ROOT, ".venv-hf", "bin", "python")


def fused(tensors, hf):
    """The per-expert tensors as transformers holds them in memory: gate_up_proj [E, 2F, D] (gate rows
    first), down_proj [E, D, F] (its conversion_mapping: MergeModulelist then Concatenate on dim 1)."""
    out = dict(tensors)
    for i in range(hf["first_k_dense_replace"], hf["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        take = lambda name: np.stack([out.pop(f"{p}{e}.{name}.weight") for e in range(hf["n_routed_experts"])])
        out[p + "gate_up_proj"] = np.concatenate([take("gate_proj"), take("up_proj")], axis=1)
        out[p + "down_proj"] = take("down_proj")
    return out


class Shape:
    """The ModelConfig fields params_to_hf reads."""

    def __init__(self, hf):
        self.vocab_size, self.n_head = hf["vocab_size"], hf["num_attention_heads"]
        self.first_k_dense = hf["first_k_dense_replace"]
        self.blocks = hf["num_hidden_layers"] - self.first_k_dense
        self.tied_embeddings = hf["tie_word_embeddings"]


# ----------------------------------------------------------------------------------------------------------
# The mapping


@pytest.mark.parametrize("tied", [False, True])
def test_hf_tensors_round_trip_bitwise(tied):
    hf = HF | {"tie_word_embeddings": tied}
    tensors = random_tensors(hf)
    params, bias = convert.params_from_hf(dict(tensors), hf, padded_vocab=384)
    assert params["embed"].shape == (384, 24) and not params["embed"][300:].any()
    assert ("unembed" in params) == (not tied)
    assert params["prologue"]["ffn"]["w_gate"].shape == (2, 24, 40)
    assert params["blocks"]["moe"]["moe"]["expert_up"].shape == (3, 5, 24, 9)
    assert params["blocks"]["moe"]["moe"]["shared_down"].shape == (3, 2, 9, 24)
    assert bias.shape == (3, 5)
    back = convert.params_to_hf(params, bias, Shape(hf))
    assert sorted(back) == sorted(tensors) and len(back) == 2 * (9 + 3) + 3 * (9 + 2 + 5 * 3 + 3) + 2 + (not tied)
    for name, w in tensors.items():
        assert back[name].dtype == np.float32 and back[name].flags.c_contiguous
        np.testing.assert_array_equal(back[name], w, err_msg=name)


def leaves(tree, prefix=""):
    """[(path, array)] of a nested dict, depth first in key order."""
    return [item for key, value in sorted(tree.items()) for item in
            (leaves(value, f"{prefix}{key}/") if isinstance(value, dict) else [(prefix + key, value)])]


def test_fused_experts_read_as_per_expert():
    tensors = random_tensors(HF)
    params, bias = convert.params_from_hf(dict(tensors), HF, 384)
    params_fused, bias_fused = convert.params_from_hf(fused(tensors, HF), HF, 384)
    assert [name for name, _ in leaves(params)] == [name for name, _ in leaves(params_fused)]
    for (name, a), (_, b) in zip(leaves(params), leaves(params_fused)):
        np.testing.assert_array_equal(a, b, err_msg=name)
    np.testing.assert_array_equal(bias, bias_fused)


def test_layout_by_hand():
    """The transformers rows of each fused tensor, written out for one head and one expert."""
    tensors = random_tensors(HF)
    params, bias = convert.params_from_hf(dict(tensors), HF, 384)
    K, R, V, H = 10, 6, 7, 3
    perm = [0, 3, 1, 4, 2, 5]                    # theirs[2i] = ours[i], theirs[2i + 1] = ours[i + R/2]
    assert list(convert.rope_to_hf(R)) == perm
    layer = convert.layer_of(params["blocks"]["moe"], 1)                           # layer 3 = block 1
    attn, moe = layer["attn"], layer["moe"]
    q_b = tensors["model.layers.3.self_attn.q_b_proj.weight"].reshape(H, K + R, -1)
    h = 2
    np.testing.assert_array_equal(q_b[h, :K], attn["w_uq"][:, h * K:(h + 1) * K].T)
    np.testing.assert_array_equal(q_b[h, K:], attn["w_qr"][:, h * R:(h + 1) * R][:, perm].T)
    kv_a = tensors["model.layers.3.self_attn.kv_a_proj_with_mqa.weight"]
    np.testing.assert_array_equal(kv_a[:12], attn["w_dkv"].T)
    np.testing.assert_array_equal(kv_a[12:], attn["w_kr"][:, perm].T)
    kv_b = tensors["model.layers.3.self_attn.kv_b_proj.weight"].reshape(H, K + V, -1)
    np.testing.assert_array_equal(kv_b[h, :K], attn["w_uk"][:, h * K:(h + 1) * K].T)
    np.testing.assert_array_equal(kv_b[h, K:], attn["w_uv"][:, h * V:(h + 1) * V].T)
    np.testing.assert_array_equal(tensors["model.layers.3.self_attn.o_proj.weight"], attn["w_o"].T)
    np.testing.assert_array_equal(tensors["model.layers.3.mlp.experts.4.up_proj.weight"], moe["expert_up"][4].T)
    np.testing.assert_array_equal(tensors["model.layers.3.mlp.experts.4.down_proj.weight"], moe["expert_down"][4].T)
    np.testing.assert_array_equal(tensors["model.layers.3.mlp.gate.weight"], moe["router"].T)
    np.testing.assert_array_equal(tensors["model.layers.3.mlp.gate.e_score_correction_bias"], bias[1])
    np.testing.assert_array_equal(tensors["model.layers.0.mlp.gate_proj.weight"],
                                  params["prologue"]["ffn"]["w_gate"][0].T)


def test_shared_experts_are_one_wider_mlp():
    """transformers' one shared MLP of n x F units computes the sum of our n shared experts' MLPs."""
    tensors = random_tensors(HF)
    params, _ = convert.params_from_hf(dict(tensors), HF, 384)
    moe = {k: v[0] for k, v in params["blocks"]["moe"]["moe"].items()}
    x = np.random.default_rng(1).standard_normal((4, 24)).astype(np.float64)
    silu = lambda a: a / (1 + np.exp(-a))
    mlp = lambda x, gate, up, down: (silu(x @ gate) * (x @ up)) @ down
    ours = sum(mlp(x, moe["shared_gate"][s], moe["shared_up"][s], moe["shared_down"][s]) for s in range(2))
    p = "model.layers.2.mlp.shared_experts."
    theirs = mlp(x, *(tensors[f"{p}{n}_proj.weight"].T for n in ("gate", "up", "down")))
    np.testing.assert_allclose(theirs, ours, rtol=1e-12, atol=1e-12)


def test_rope_permutation_is_transformers_interleaved_rotation():
    """Our rotation of the pairs (i, i + R/2) equals transformers' apply_rotary_pos_emb_interleave (written out
    in numpy from its source) of the permuted channels, output for output: the same pairs, the same angles."""
    import jax.numpy as jnp

    from model import rope
    R, T, base = 8, 11, 10_000.0
    x = np.random.default_rng(0).standard_normal((T, R)).astype(np.float32)
    ours = np.asarray(rope(jnp.asarray(x)[None], jnp.arange(T), base))[0]
    inv_freq = 1.0 / (base ** (np.arange(0, R, 2, dtype=np.float32) / R))         # their default rope init
    angle = np.arange(T, dtype=np.float32)[:, None] * inv_freq
    cos, sin = np.cos(angle), np.sin(angle)
    xh = x[:, convert.rope_to_hf(R)]
    x1, x2 = xh[:, 0::2], xh[:, 1::2]
    theirs = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    np.testing.assert_allclose(theirs, ours, rtol=0, atol=2e-6)


def test_wrong_shapes_and_missing_or_unused_tensors_are_named():
    tensors = random_tensors(HF)
    bad = dict(tensors, **{"model.layers.1.self_attn.kv_b_proj.weight": np.zeros((3, 12), np.float32)})
    with pytest.raises(convert.ConvertError, match=r"model.layers.1.self_attn.kv_b_proj.weight has shape \(3, 12\); "
                                                   r"config.json's model gives it \(51, 12\)"):
        convert.params_from_hf(bad, HF, 384)
    missing = {k: v for k, v in tensors.items() if k != "model.layers.4.mlp.experts.3.up_proj.weight"}
    with pytest.raises(convert.ConvertError, match="model.layers.4.mlp.experts.3.up_proj.weight is missing"):
        convert.params_from_hf(missing, HF, 384)


# ----------------------------------------------------------------------------------------------------------
# Files


def test_safetensors_one_file_or_shards_with_an_index(tmp_path):
    tensors = random_tensors(HF)
    one = tmp_path / "one"
    one.mkdir()
    assert hf_files.write_safetensors(str(one), tensors, 10**9) == ["model.safetensors"]
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    limit = 40_000
    files = hf_files.write_safetensors(str(sharded), tensors, limit)
    index = json.loads((sharded / hf_files.INDEX).read_text())
    assert files[-1] == hf_files.INDEX and len(files) > 3
    assert files[:-1] == [f"model-{i:05d}-of-{len(files) - 1:05d}.safetensors" for i in range(1, len(files))]
    assert index["metadata"]["total_size"] == sum(w.nbytes for w in tensors.values())
    assert sorted(index["weight_map"]) == sorted(tensors)
    for file in files[:-1]:
        names = [n for n, f in index["weight_map"].items() if f == file]
        assert sum(tensors[n].nbytes for n in names) <= limit or len(names) == 1
    for directory in (one, sharded):
        back = hf_files.read_safetensors(str(directory))
        assert sorted(back) == sorted(tensors)
        for name, w in tensors.items():
            np.testing.assert_array_equal(back[name], w)
    os.remove(sharded / files[0])
    named = f"{sharded / files[0]} is missing \\({sharded / hf_files.INDEX} names it\\)"
    with pytest.raises(convert.ConvertError, match=named):
        hf_files.read_safetensors(str(sharded))
    with pytest.raises(convert.ConvertError, match="has neither model.safetensors nor model.safetensors.index.json"):
        hf_files.read_safetensors(str(tmp_path))


def test_parse_size():
    assert hf_files.parse_size("5GB") == 5 * 10**9 and hf_files.parse_size("200mb") == 2 * 10**8
    assert hf_files.parse_size("1234") == 1234
    for bad in ("", "GB", "-1MB", "lots"):
        with pytest.raises(convert.ConvertError, match="--max_shard_size"):
            hf_files.parse_size(bad)


def bpe_encode(text, tokenizer):
    """What tokenizers does with tokenizer.json (written out for the check): split with the pattern, map
    each piece's bytes to GPT-2's stand-in characters, take a piece that is in the vocabulary whole
    (ignore_merges), else apply the merges lowest rank first (leftmost on a tie)."""
    model = tokenizer["model"]
    vocab, ranks = model["vocab"], {tuple(m): i for i, m in enumerate(model["merges"])}
    chars = hf_tokenizer.byte_chars()
    pattern = tokenizer["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"]
    ids = []
    for piece in regex.findall(pattern, text):
        word = "".join(chars[b] for b in piece.encode("utf-8"))
        if word in vocab:
            ids.append(vocab[word])
            continue
        parts = list(word)
        while len(parts) > 1:
            rank, i = min((ranks.get((parts[i], parts[i + 1]), len(ranks)), i) for i in range(len(parts) - 1))
            if rank == len(ranks):
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        ids.extend(vocab[p] for p in parts)
    return ids


TRICKY = ["", " ", "\n", "\r\n", " \n\n ", "Hello  world!!", "I'M DON'T you'll we've 's 'S 'Ll", "12345 1234567",
          "<|endoftext|>", "a<|endoftext|>b<|fim_prefix|>", "日本語のテキスト", "emoji 👍🏽 family 👨‍👩‍👧",
          "tabs\t\tand\u00a0nbsp", "trailing   ", "   leading", "x" * 300, "é" * 50, "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "\x00\x01ctrl",
          "def f(x):\n    return x  # comment\n\n\n", "$$$ ... ??? !!!"]


def test_tokenizer_files_rebuild_tiktoken():
    """tokenizer.json's vocabulary, merges and pattern rebuild encode_ordinary on the bundled corpus' first
    100 chapters and on strings with what BPE exporters get wrong (digit runs, whitespace before a newline
    and at the end, contractions, special tokens inside text, astral characters). transformers' own
    AutoTokenizer is checked against the whole corpus in the opt-in test."""
    from data import corpus
    from data.tokenizer import EOT_ID, get_tokenizer
    enc = get_tokenizer()
    files = hf_tokenizer.tokenizer_files(64)
    tokenizer, config = files["tokenizer.json"], files["tokenizer_config.json"]
    assert len(tokenizer["model"]["vocab"]) == 100_256 and len(tokenizer["model"]["merges"]) == 100_000
    # the added tokens one after another from the vocabulary's end (the ids tokenizers gives them), the
    # unused ids between cl100k_base's special tokens filled
    added = {t["id"]: t["content"] for t in tokenizer["added_tokens"]}
    assert list(added) == list(range(100_256, 100_277))
    assert {i: s for i, s in added.items() if not s.startswith("<|reserved_")} == {
        100257: "<|endoftext|>", 100258: "<|fim_prefix|>", 100259: "<|fim_middle|>", 100260: "<|fim_suffix|>",
        100276: "<|endofprompt|>"}
    assert all(t["special"] for t in tokenizer["added_tokens"]) and config["split_special_tokens"]
    assert tokenizer["post_processor"]["special_tokens"]["<|endoftext|>"]["ids"] == [EOT_ID]
    with gzip.open(corpus.PATH, "rt") as f:
        chapters = [json.loads(line)["text"] for _, line in zip(range(100), f)]
    for text in TRICKY + chapters:
        assert bpe_encode(text, tokenizer) == enc.encode_ordinary(text), text[:60]


# ----------------------------------------------------------------------------------------------------------
# Configs and refusals


def test_import_refusals_name_each_field():
    assert convert.import_refusals(HF) == []
    bad = HF | {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40}, "n_group": 8,
                "topk_group": 4, "q_lora_rank": None, "attention_bias": True, "quantization_config": {},
                "num_key_value_heads": 1, "rms_norm_eps": 1e-5, "first_k_dense_replace": 5}
    refusals = convert.import_refusals(bad)
    for field in ("rope type 'yarn'", "n_group 8 with topk_group 4", "q_lora_rank null", "attention_bias true",
                  "quantization_config", "num_key_value_heads 1", "rms_norm_eps 1e-05", "first_k_dense_replace 5"):
        assert sum(r.startswith(field) for r in refusals) == 1, (field, refusals)
    assert len(refusals) == 8
    # transformers 4's spelling of the same RoPE
    legacy = {k: v for k, v in HF.items() if k != "rope_parameters"} | {"rope_theta": 5e4, "rope_scaling": {
        "type": "yarn", "factor": 40}}
    assert convert.import_refusals(legacy) == ["rope type 'yarn' (only the default RoPE: no yarn or other rope "
                                               "scaling)"]
    # every group picked: no limit
    assert convert.import_refusals(HF | {"n_group": 4, "topk_group": 4}) == []


def test_config_json_is_read_as_transformers_reads_it(tmp_path):
    """A field left out takes DeepseekV3Config's default (topk_group 4, DeepSeek-V3's), null key-value heads
    mean one per head."""
    short = {k: v for k, v in HF.items() if k not in convert.HF_DEFAULTS or k in ("n_group", "hidden_size")}
    (tmp_path / "config.json").write_text(json.dumps(short | {"num_key_value_heads": None}))
    hf = convert.read_hf_config(str(tmp_path))
    assert hf["topk_group"] == 4 and hf["num_key_value_heads"] == 128 and hf["hidden_size"] == 24
    assert convert.import_refusals(hf) == [
        "n_group 1 with topk_group 4 (group-limited routing; only topk_group = n_group, which limits nothing)"]


def test_cli_refuses_bad_paths_in_one_line(tmp_path, capsys):
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "x").write_text("x")
    cases = [(["from-hf", str(tmp_path / "nothing"), str(tmp_path / "run")], "nothing/config.json is missing"),
             (["from-hf", str(tmp_path), str(occupied)], "RUN_DIR .*occupied exists and is not an empty directory"),
             (["to-hf", str(tmp_path / "norun"), str(occupied)], "HF_DIR .*occupied exists"),
             (["to-hf", str(tmp_path / "norun"), str(tmp_path / "hf"), "--max_shard_size", "big"], "--max_shard_size")]
    for argv, message in cases:
        assert convert.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: "), err
        assert regex.search(message, err), (message, err)
    (tmp_path / "config.json").write_text(json.dumps(HF | {"rope_scaling": {"type": "yarn"}, "rope_parameters": None}))
    assert convert.main(["from-hf", str(tmp_path), str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "rope type 'yarn'" in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------------------------------------
# The commands end to end, on checkpoints saved as main.py saves them


def save_run(run_dir, mc, seed=0):
    """run_dir with one checkpoint (step 5) of a fresh state of ModelConfig mc, every norm scale and the
    routing bias moved off their init (ones, zeros) so that a swapped one shows; metadata as main.py's."""
    import dataclasses
    import uuid

    import jax

    import sharding
    import utils
    from checkpoints import checkpoint_manager, checksums_and_finite, save, wait_for_save
    from trainer import build_trainer
    trainer = build_trainer(utils.Config(model=mc), sharding.make_mesh((1, 1, 1), jax.devices()[:1]))
    state = trainer.fresh_state(seed)
    keys = iter(jax.random.split(jax.random.key(seed + 1), 1000))
    moved = lambda path, w: (w + 0.2 * jax.random.normal(next(keys), w.shape) if "norm" in jax.tree_util.keystr(path)
                             else w)
    state["params"] = jax.tree_util.tree_map_with_path(moved, state["params"])
    state["router_bias"] = 0.05 * jax.random.normal(next(keys), state["router_bias"].shape)
    mngr = checkpoint_manager(str(run_dir))
    sums, _ = jax.device_get(checksums_and_finite(state))
    save(mngr, 5, state, {"step": 5, "sequences": 80, "run_id": uuid.uuid4().hex[:8], "model": dataclasses.asdict(mc),
                          "val_loss": None, "checksums": {k: int(v) for k, v in sums.items()}})
    wait_for_save(mngr)
    mngr.close()


def dsv3_tiny(**changes):
    import dataclasses

    import utils
    return dataclasses.replace(utils.PRESETS["dsv3-tiny"].model, **changes)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """dsv3-tiny saved, exported with small shards, imported back."""
    work = tmp_path_factory.mktemp("exported")
    save_run(work / "run", dsv3_tiny())
    convert.to_hf(str(work / "run"), str(work / "hf"), max_shard_bytes=5 * 10**6)
    mc, flags = convert.from_hf(str(work / "hf"), str(work / "back"))
    return work, mc, flags


def test_round_trip_is_bitwise(exported):
    """to-hf then from-hf: every array of the params and the routing bias equal, bit for bit; to-hf of the
    import writes the same tensors again."""
    import jax
    work, mc, _ = exported
    _, params, bias, _ = convert.read_checkpoint(str(work / "run"))
    mc_back, params_back, bias_back, where = convert.read_checkpoint(str(work / "back"))
    assert where.endswith("back/checkpoints/0")
    leaves, leaves_back = (jax.tree_util.tree_leaves_with_path({"params": p, "router_bias": b})
                           for p, b in ((params, bias), (params_back, bias_back)))
    assert [path for path, _ in leaves] == [path for path, _ in leaves_back] and len(leaves) > 20
    for (path, a), (_, b) in zip(leaves, leaves_back):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), jax.tree_util.keystr(path)
    convert.to_hf(str(work / "back"), str(work / "again"), max_shard_bytes=5 * 10**6)
    first, again = hf_files.read_safetensors(str(work / "hf")), hf_files.read_safetensors(str(work / "again"))
    assert sorted(first) == sorted(again)
    assert all(first[name].tobytes() == again[name].tobytes() for name in first)


def test_export_files(exported):
    work, mc, _ = exported
    names = sorted(os.listdir(work / "hf"))
    assert hf_files.INDEX in names and "tokenizer.json" in names and "tokenizer_config.json" in names
    assert sum(n.endswith(".safetensors") for n in names) > 1
    config = json.loads((work / "hf" / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["rope_interleave"] and config["n_group"] == 1
    assert config["num_hidden_layers"] == mc.first_k_dense + mc.blocks and config["bos_token_id"] == 100257
    tensors = hf_files.read_safetensors(str(work / "hf"))
    assert {n: tuple(w.shape) for n, w in tensors.items()} == convert.hf_shapes(config)
    assert all(w.dtype == np.float32 for w in tensors.values())


def test_hf_config_and_model_fields_invert(exported):
    import dataclasses
    _, mc, _ = exported
    for changes in ({}, {"tied_embeddings": True, "renormalize_gates": False, "routed_scaling": 1.5, "rope_base": 5e4,
                         "qk_head_dim": 12, "v_head_dim": 8, "ffn_hidden_dim": 96, "moe_hidden_dim": 24}):
        want = dataclasses.replace(mc, **changes)
        back = convert.model_fields(convert.hf_config(want))
        assert {k: v for k, v in dataclasses.asdict(want).items() if k in back} == back


def test_imported_run_fine_tunes_on_another_mesh(exported, cpu_env):
    """main.py with the flags from-hf prints restores the step-0 checkpoint on a (1, 1, 2) mesh and trains."""
    work, _, flags = exported
    cmd = [sys.executable, os.path.join(ROOT, "main.py"), "--output_dir", str(work), "--name", "back", *flags,
           "--training_steps", "2", "--checkpoint_steps", "2", "--eval_steps", "1", "--max_tokens", "0",
           "--eval_tasks", "", "--n_device_axis", "1", "1", "2", "--cpu_devices", "2"]
    # XLA at -O0: a model and mesh of this test's own, 2 steps
    proc = subprocess.run(cmd, cwd=ROOT, env=cpu_env | unoptimized(cpu_env), capture_output=True, text=True,
                          timeout=CEILING_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"resumed from {work}/back/checkpoints/0: step 0" in proc.stdout
    assert "final: val cross-entropy" in proc.stdout and "note:" not in proc.stdout


def test_guide_preset_is_refused_in_one_line(tmp_path, capsys):
    import utils
    save_run(tmp_path / "tiny", utils.PRESETS["tiny"].model)
    assert convert.main(["to-hf", str(tmp_path / "tiny"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds a model with no DeepSeek-V3 equivalent" in err
    for wrong in ("--ffn gelu (needs --ffn gated_silu)", "--norm_shift true (needs --norm_shift false)",
                  "--latent_norm false (needs --latent_norm true)",
                  "--rope_all_layers false (needs --rope_all_layers true)",
                  "--layers_per_block 2 (needs --layers_per_block 1"):
        assert wrong in err, (wrong, err)
    assert err.rstrip().endswith("; python main.py --preset dsv3-tiny trains one that exports, as does this model "
                                 "with those flags"), err
    assert not (tmp_path / "hf").exists()


def test_special_tokens_keep_their_ids_in_tokenizers_and_transformers(exported):
    """Each cl100k_base special token at tiktoken's id through tokenizers' Tokenizer.from_file and transformers'
    AutoTokenizer (ids, tokens, decode), AutoTokenizer's bos/eos those of config.json. The tokenizers library
    numbers added tokens one after another from the end of the BPE vocabulary, whatever ids tokenizer.json
    gives them: before the export filled the unused ids, <|endoftext|> came out as 100256, not 100257."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from data.tokenizer import EOT_ID, get_tokenizer
    hf_dir = exported[0] / "hf"
    enc, config = get_tokenizer(), json.loads((hf_dir / "config.json").read_text())
    fast = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    specials = {enc.encode_single_token(s): s for s in enc.special_tokens_set}
    assert len(specials) == 5
    for i, s in specials.items():
        assert (fast.token_to_id(s), fast.id_to_token(i), fast.decode([i], skip_special_tokens=False)) == (i, s, s)
        assert (auto.convert_tokens_to_ids(s), auto.convert_ids_to_tokens(i), auto.decode([i])) == (i, s, s)
    assert auto.bos_token_id == auto.eos_token_id == config["bos_token_id"] == config["eos_token_id"] == EOT_ID
    assert auto.decode([100257]) == "<|endoftext|>" and fast.id_to_token(100257) == "<|endoftext|>"
    assert fast.get_vocab_size() == len(auto) == enc.n_vocab == config["vocab_size"]
    text = "And God said, <|fim_prefix|> 1234567"
    assert auto(text)["input_ids"] == [EOT_ID] + enc.encode_ordinary(text)
    assert auto.decode(auto(text)["input_ids"], skip_special_tokens=True) == text


def test_exported_files_honour_the_umask(exported, tmp_path):
    """Every exported file has the mode an ordinary new file gets here (0644 under umask 022): safetensors
    writes through a temporary file of mode 0600, which the export used to keep."""
    (tmp_path / "ordinary").write_text("")
    ordinary = (tmp_path / "ordinary").stat().st_mode & 0o777
    hf_dir = exported[0] / "hf"
    modes = {name: oct((hf_dir / name).stat().st_mode & 0o777) for name in os.listdir(hf_dir)}
    assert modes == dict.fromkeys(modes, oct(ordinary)), modes


def test_the_docs_exports_are_ignored_by_git():
    """Each HF_DIR a to-hf command in the docs writes inside the clone is ignored by git."""
    if not os.path.isdir(os.path.join(ROOT, ".git")):
        pytest.skip("not a git clone")
    docs = "".join(open(os.path.join(ROOT, "docs", name)).read() for name in os.listdir(os.path.join(ROOT, "docs")))
    paths = sorted({hf_dir for hf_dir in regex.findall(r"convert\.py to-hf \S+ ([\w./-]+)", docs)
                    if not hf_dir.isupper()})
    assert "hf/dsv3-tiny" in paths, paths
    for hf_dir in paths:
        for name in ("model.safetensors", "model-00001-of-00002.safetensors", "config.json", "tokenizer.json"):
            proc = subprocess.run(["git", "check-ignore", "-q", f"{hf_dir}/{name}"], cwd=ROOT)
            assert proc.returncode == 0, f"{hf_dir}/{name} is not ignored"


def test_to_hf_onto_a_full_disk_is_one_line(exported, tmp_path, cpu_env, monkeypatch):
    """to-hf onto a 1 MB disk: one line naming HF_DIR and the space it needs, exit 2, nothing left (a
    traceback and exit 1 before). A disk that fills up while the files are written (its free space
    reported as plenty): one line too, nothing left."""
    disk = tmp_path / "disk"
    os.makedirs(disk)
    mount("-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk))
    try:
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "convert.py"), "to-hf", str(exported[0] / "run"),
                               str(disk / "hf")], cwd=ROOT, env=cpu_env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr[-3000:]
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert regex.fullmatch(rf"error: HF_DIR {regex.escape(str(disk / 'hf'))} needs about \d\d\.\d MB; its disk "
                               r"has 1\.0 MB free\. Free some space or give another HF_DIR", errors[0]), errors[0]
        assert os.listdir(disk) == []
        usage = shutil.disk_usage(disk)
        monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=10**12))
        tensors = {"w": np.zeros(500_000, np.float32)}
        with pytest.raises(convert.ConvertError) as refused:
            hf_files.write_atomically(str(disk / "hf"), "HF_DIR", 2 * 10**6,
                                      lambda tmp: hf_files.write_safetensors(tmp, tensors, 10**9))
        assert str(refused.value) == (f"HF_DIR {disk}/hf: [Errno 28] No space left on device (it needs about 2.0 MB). "
                                      f"Free some space or give another HF_DIR")
        assert os.listdir(disk) == []
    finally:
        subprocess.run(["umount", str(disk)], check=True)


# ----------------------------------------------------------------------------------------------------------
# The opt-in comparison with transformers


@pytest.mark.slow("AutoTokenizer on the whole bundled corpus, about 40 s")
def test_transformers_tokenizer_encodes_as_tiktoken(tmp_path):
    """The card's tokenizer check (no torch: transformers' tokenizer is in requirements.txt)."""
    from data.tokenizer import EOT_ID
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    for name, value in hf_tokenizer.tokenizer_files(64).items():
        (hf_dir / name).write_text(json.dumps(value))
    (hf_dir / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "bos_token_id": EOT_ID,
                                                    "eos_token_id": EOT_ID}))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "verification_card.py"), "tokenizer",
                          str(hf_dir)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 differ" in out.stdout and "each at tiktoken's id" in out.stdout, out.stdout


def card(*args):
    """scripts/verification_card.py ARGS in .venv-hf; its output."""
    out = subprocess.run([HF_PYTHON, os.path.join(ROOT, "scripts", "verification_card.py"), *map(str, args)],
                         capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow("transformers in a virtualenv of its own")
@pytest.mark.skipif(not os.path.exists(HF_PYTHON), reason="needs a virtualenv from requirements-hf.txt in .venv-hf")
def test_transformers_matches_our_export_and_we_match_its_model(exported, tmp_path):
    """transformers' DeepseekV3ForCausalLM loaded from our export gives our logits (fp32, within 1e-4) and our
    32 greedy tokens; a random one it made, imported with from-hf, gives its logits and tokens here."""
    work = exported[0]
    for hf_dir, run_dir in ((work / "hf", work / "run"), (tmp_path / "random", tmp_path / "imported")):
        if hf_dir.name == "random":
            card("random-hf", hf_dir)
            convert.from_hf(str(hf_dir), str(run_dir))
        assert "within 0.0001" in card("logits", hf_dir, run_dir)
        assert "identical" in card("generate", hf_dir, run_dir)
