"""Configuration: the config dataclasses, presets, the CLI and validation.

Every shape rule the model and the mesh rely on is checked here, before any JAX computation, so that a
bad flag gets one message naming the flag and the valid values rather than a trace error deep in XLA.
The CLI keeps the flag names of the JAXformer guide, so its commands paste unchanged. Each config
field's meaning is written once, as its `flag(default, help)`, and `--help` shows it.
"""
import argparse
import dataclasses
import difflib
import math
from dataclasses import dataclass, field

import hardware
from parallel_dims import PP, TP, ParallelDims


# The embedding table is padded to a multiple of this many rows, independent of the mesh, so that a
# checkpoint written on one mesh restores on any other and the vocab splits evenly over tp.
VOCAB_PAD_MULTIPLE = 128


def flag(default, help):
    """A config field and its --help text: the one place that says what the field means."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = flag(100_277, "vocabulary size (cl100k_base: 100,277)")
    model_dimension: int = flag(128, "d_model")
    n_head: int = flag(4, "attention heads")
    blocks: int = flag(2, "blocks (split over pp); each is layers_per_block layers")
    layers_per_block: int = flag(2, "layers per block; the last is MoE + NoPE, the rest dense + RoPE")
    T: int = flag(128, "context length")
    latent_dim: int = flag(32, "KV latent width (c_kv)")
    q_latent_dim: int = flag(32, "query latent width (c_q)")
    dhR: int = flag(16, "decoupled RoPE width per head (even)")
    n_experts: int = flag(4, "routed experts E")
    k: int = flag(2, "experts per token")
    n_shared: int = flag(1, "shared experts, always added")
    capacity_factor: float = flag(1.5, "expert capacity factor; 0 = dropless")
    dropout_rate: float = flag(0.0, "dropout rate")
    model_dtype: str = flag("bfloat16", "matmul dtype: bfloat16 or float32; master weights are always fp32")
    alpha: float = flag(1e-4, "sequence-wise balance loss coefficient, applied in every MoE layer (the loss adds "
                              "the layers')")
    rope_base: float = flag(10_000.0, "RoPE frequency base")
    remat: str = flag("auto", "what the backward pass recomputes, layer by layer: full (everything), dots (all "
                              "but the matmul outputs), none, or auto: on a TPU none where that step fits (its layers "
                              "traced apart, up to 32), else dots; full on a GPU or CPU; "
                              "under tp full and dots keep each branch's all-reduced output rather than "
                              "all-reduce it again")
    fsdp_gather: str = flag("step", "when each pipeline stage's weights are all-gathered over dp: step (once a step "
                                    "for all of its ticks, held in fp32 for the step: the fewest collective bytes) or "
                                    "tick (at every tick, only the blocks that tick runs, their gradient "
                                    "reduce-scattered after it: the guide's way, the memory of one tick's weights)")
    moe_impl: str = flag("buffers", "routed-expert compute: buffers (per-expert capacity slots) or ragged "
                                    "(sorted tokens, lax.ragged_dot); --engine reference always runs buffers")
    # DeepSeek-V3's architecture, each option the guide's behaviour by default (docs/model.md; --preset dsv3-tiny)
    ffn: str = flag("gelu", "feed-forward: gelu (the guide's, up -> GELU -> down) or gated_silu (DeepSeek-V3's "
                            "SiLU(x W_gate) x (x W_up) -> down), in the dense layers and every expert")
    ffn_hidden_dim: int = flag(0, "hidden units of the dense FFN (0: 4 x --model_dimension)")
    moe_hidden_dim: int = flag(0, "hidden units of each routed and shared expert (0: the dense FFN's)")
    qk_head_dim: int = flag(0, "content width per head of queries and keys, without the rotary part (0: "
                               "--model_dimension / --n_head)")
    v_head_dim: int = flag(0, "value width per head (0: --qk_head_dim's)")
    norm_shift: bool = flag(True, "every RMSNorm has a learned shift besides its scale (the guide's); false: scale "
                                  "only (DeepSeek-V3)")
    latent_norm: bool = flag(False, "an RMSNorm on the query and the KV latent (DeepSeek-V3's q_a_layernorm and "
                                    "kv_a_layernorm)")
    rope_all_layers: bool = flag(False, "decoupled RoPE in every layer (DeepSeek-V3); false: the MoE layer of each "
                                        "block has none (NoPE, the guide's)")
    first_k_dense: int = flag(0, "dense layers before the blocks (DeepSeek-V3's first_k_dense_replace); they run "
                                 "before the pipeline, on every pp stage")
    tied_embeddings: bool = flag(True, "the output layer is the token table (the guide's); false: a table of its own")
    routed_scaling: float = flag(1.0, "the routed experts' gated output scaled by this (DeepSeek-V3's "
                                      "routed_scaling_factor)")
    renormalize_gates: bool = flag(True, "the k chosen scores renormalised to sum to 1 as the gates (the guide's and "
                                         "DeepSeek-V3's norm_topk_prob); false: the scores themselves")
    engine: str = flag("fast", "what the model's math runs on (engine/): fast (fused attention, custom-VJP "
                               "products, chunked cross-entropy, named remat) or reference (the guide's plain "
                               "math at every seam, the same numbers in fp32: for reading and debugging)")
    expert_parallel: bool = flag(False, "expert parallelism over dp: each dp shard holds E/DP whole routed experts "
                                        "(hidden units still split over tp) and tokens go to them and back by "
                                        "all-to-all over dp, instead of every expert being all-gathered over dp; "
                                        "routing and drops are unchanged; needs --n_experts divisible by DP. With "
                                        "--moe_impl ragged only kept tokens travel, by ragged all-to-all, which "
                                        "XLA:CPU does not implement (TPU only; --compile_for checks it)")
    pipeline_repeats: int = flag(1, "circular pipeline: P > 1 gives each pp stage P non-adjacent groups of blocks "
                                    "and sends the micro-batches P times around the stages, so the bubble is "
                                    "(PP - 1)/(P M + PP - 1) instead of GPipe's (PP - 1)/(M + PP - 1); 1 = GPipe. "
                                    "--blocks must be divisible by PP x P. The state stores the blocks as [P, blocks/P, "
                                    "...] (a reshape: a checkpoint restores with any P)")

    @property
    def head_dim(self):
        return self.qk_head_dim or self.model_dimension // self.n_head

    @property
    def value_dim(self):
        return self.v_head_dim or self.head_dim

    @property
    def ffn_dim(self):
        return self.ffn_hidden_dim or 4 * self.model_dimension

    @property
    def expert_dim(self):
        return self.moe_hidden_dim or self.ffn_dim

    @property
    def padded_vocab(self):
        return -(-self.vocab_size // VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE

    @property
    def n_layers(self):
        return self.first_k_dense + self.blocks * self.layers_per_block


@dataclass(frozen=True)
class OptimConfig:
    max_lr: float = flag(3e-3, "peak learning rate")
    min_lr: float = flag(3e-4, "lr at step 0, warmed up linearly to max_lr")
    end_lr: float = flag(3e-4, "lr reached by the cosine at end_steps, held after")
    warmup_steps: int = flag(30, "linear warmup from min_lr to max_lr")
    end_steps: int = flag(300, "step at which the cosine reaches end_lr")
    training_steps: int = flag(300, "optimizer steps of the run")
    grad_step: int = flag(1, "gradient-accumulation steps per optimizer step")
    grad_clip_norm: float = flag(1.0, "clip the gradient to this global norm (over all shards)")
    skip_spikes: float = flag(0.0, "skip the optimizer update of a step whose grad norm exceeds this multiple of "
                                   "the median of the previous 20 steps' (0 = off; e.g. 5); skipped steps are "
                                   "counted in the metrics")
    weight_decay: float = flag(0.1, "AdamW weight decay, matrices only")
    b1: float = flag(0.9, "Adam b1")
    b2: float = flag(0.95, "Adam b2")
    embed_eps: float = flag(1e-4, "Adam epsilon of the tied embedding table (every other leaf: 1e-8): rows whose "
                                  "gradient is below it, i.e. tokens rarer than about this probability, move in "
                                  "proportion to it instead of at Adam's full step, which would collapse the rows "
                                  "of unseen tokens into one vector (spikes.py); > 0")
    bias_update_rate: float = flag(0.0, "DeepSeek-V3 aux-loss-free balancing: top-k picks experts on score + a "
                                        "per-expert bias that moves this much after every step toward the mean "
                                        "load (0 = off; DeepSeek-V3: 1e-3)")


@dataclass(frozen=True)
class RunConfig:
    name: str = flag("tiny", "the run's name: it lives in OUTPUT_DIR/NAME")
    output_dir: str = flag("runs", "runs live in OUTPUT_DIR/NAME: a local dir or any fsspec URL (gs://bucket/runs), "
                                   "where every host writes its checkpoint parts and process 0 the metrics and "
                                   "samples")
    data_dir: str = flag("", "token shards (dir or gs:// URL) with a manifest; empty = the bundled corpus, cached")
    train_batch_size: int = flag(16, "sequences per data-parallel replica per micro-step (global batch = DP x this)")
    val_batch_size: int = flag(16, "validation sequences per eval batch in all (the guide: per replica): the "
                                   "validation set is --eval_steps batches of this many, the same windows on "
                                   "every mesh; a multiple of DP x --micro_batch_size")
    micro_batch_size: int = flag(2, "NUMBER of pipeline micro-batches per step (not their size; the guide's "
                                    "meaning)")
    checkpoint_steps: int = flag(50, "eval/log interval in steps; a checkpoint is saved every 10 intervals, at the "
                                     "end and on SIGTERM or Ctrl-C")
    eval_on_stop: bool = flag(False, "after a stop's checkpoint is written (SIGTERM, Ctrl-C, a lost terminal), also "
                                     "evaluate, score --eval_tasks and sample before exiting (the save never "
                                     "waits for them)")
    eval_steps: int = flag(4, "validation batches per evaluation")
    eval_tasks: str = flag("kjv_endings", "downstream tasks scored at every checkpoint, comma-separated: "
                                          "kjv_endings, olmo_arc_easy, ... (evals/tasks.py), lm-evaluation-harness "
                                          "task names or task YAML files (evals/harness.py); '' for none")
    eval_tasks_limit: int = flag(0, "score each task's first N examples only (0 = all)")
    seed: int = flag(0, "seed of the init, the data order, dropout and the samples")
    stop_at_val_loss: float = flag(0.0, "end the run, with a checkpoint, at the first evaluation whose val "
                                        "cross-entropy is <= this (0 = off; the guide's moe1B run stopped at 3.28)")
    max_bad_steps: int = flag(3, "a step whose loss, gradient or updated state is not finite leaves the state as "
                                 "it was; this many such steps in a row end the run with exit 1 (its newest "
                                 "checkpoint, from before them, is the one to resume from)")
    hang_timeout: int = flag(1800, "seconds without progress (a step, an evaluation, a save) after the first step "
                                   "before this process writes every thread's stack to its log and exits 3: a "
                                   "collective waiting on a stopped or lost host never returns (0 = never; "
                                   "SIGUSR1 writes the stacks at any time and the run goes on)")
    heartbeat_file: str = flag("", "a local file this process rewrites at every sign of progress: its last step and "
                                   "when, what it is doing, its goodput so far (run.sh sets it; launcher.sh "
                                   "--status reads it; empty = none)")
    wandb: bool = flag(False, "log to Weights & Biases (online with WANDB_API_KEY, offline files otherwise)")
    n_device_axis: tuple = flag((1, 1, 1), "mesh sizes DP PP TP")
    n_slices: int = flag(1, "TPU slices the run spans, joined over the data-centre network (DCN) by data parallelism "
                            "only: DP of --n_device_axis counts the replicas of every slice, DP/N in each, where FSDP "
                            "shards the weights; the gradient is summed across slices once a micro-step (docs/launch.md"
                            "#two-slices)")
    cpu_devices: int = flag(0, "simulate N CPU devices (try a 3-D mesh on one machine); 0 = the real devices")
    compile_for: str = flag("", "do not train: compile this run's training and eval steps for a TPU slice (v4-64, "
                                "v5p-8, v5litepod-16, v6e-8, ...; 2xv4-32: two slices over DCN, --n_slices 2; pip "
                                "install -r requirements-tpu.txt) or for "
                                "H200s (h200, h200-8; pip install -r requirements-gpu-aot.txt) on this machine, "
                                "and print the per-chip memory plan, FLOPs, compile time and, for h200, the "
                                "estimated step time and MFU; when the train step does not fit, compile the "
                                "settings that trade compute for memory and print the cheapest that fits")
    fit: bool = flag(False, "when the train step's compiled plan does not fit the devices (or the --compile_for "
                            "target), use the setting of fewest compiled FLOPs that does (--remat full, --grad_step with "
                            "a smaller --train_batch_size, more --micro_batch_size, --expert_parallel, --fsdp_gather "
                            "tick; planning/tradeoffs.py); the choice is printed and kept in the run's config")
    force: bool = flag(False, "start even when the planned memory per device (params, optimizer state, gradients and "
                              "the layer inputs the backward keeps, from shapes alone) exceeds what this process's "
                              "devices have, which otherwise refuses the run before it allocates anything")
    restart: bool = flag(False, "start the run over: its checkpoints and logs are moved to NAME/replaced/TIME first, "
                                "never deleted (without it, a changed model flag is an error and nothing is touched)")
    evaluate: bool = flag(False, "do not train: load the newest checkpoint of --name (or --step's; saved on any "
                                 "mesh), evaluate the val set (cross-entropy, bits per byte) and --eval_tasks on this "
                                 "mesh, print them and write them to OUTPUT_DIR/NAME/evaluation-STEP.json (beside an "
                                 "earlier one of that step: evaluation-STEP.2.json, ...)")
    sample: bool = flag(False, "do not train: load the newest checkpoint of --name (or --step's; saved on any mesh), "
                               "print a sample for --prompt and exit; writes nothing")
    step: int = flag(0, "with --evaluate or --sample: the checkpoint of this step, any the run keeps, instead of the "
                        "newest readable one (0)")

    @property
    def dims(self):
        """The mesh's sizes: --n_device_axis over --n_slices."""
        return ParallelDims.of(self.n_device_axis, self.n_slices)


@dataclass(frozen=True)
class InferenceConfig:
    prompt: str = flag("And God said,", "prompt of the text samples; empty = <|endoftext|>")
    top_k: int = flag(20, "sample from the k most likely tokens")
    temperature: float = flag(0.8, "sampling temperature")
    max_tokens: int = flag(64, "tokens per sample; 0 = no samples during training")
    use_cache: bool = flag(True, "KV-cached generation (true/false)")


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    preset: str = "tiny"          # the --preset the flags were laid over


PRESETS = {
    # The embedded default: minutes on a 2-core CPU (docs/training.md), where the 100k-row output layer
    # is most of the work, so the body stays small and its activations are kept (--remat none); the step count
    # fills the time budget. With the spike fix in (spikes.py), one run each at 360 steps, val CE:
    # lr 5e-3 5.134, 7e-3 5.070, 1e-2 5.013 (before it, 7e-3 stuck on the unigram plateau).
    # One run each, so these rank the settings only loosely (other seeds of the preset: val within 0.004).
    "tiny": Config(
        model=ModelConfig(model_dimension=64, n_head=4, blocks=2, layers_per_block=2, T=64, latent_dim=32,
                          q_latent_dim=32, dhR=16, n_experts=4, k=2, n_shared=1, remat="none"),
        optim=OptimConfig(max_lr=1e-2, min_lr=1e-3, end_lr=1e-3, warmup_steps=20, end_steps=360,
                          training_steps=360),
        run=RunConfig(name="tiny", train_batch_size=16, val_batch_size=16, micro_batch_size=2,
                      checkpoint_steps=40, eval_steps=4),
        inference=InferenceConfig(max_tokens=48)),
    # The guide's headline run: a v4-64 slice (32 v4 chips on 8 hosts; v4 names count TensorCores),
    # mesh (8, 2, 2), each host's 2 x 2 chips one pp x tp plane. See `python main.py --compile_for`.
    # Its schedule: lr 0 -> 6e-4 over 5,000 steps, cosine to 6e-5 at 75,000, 100,000 steps, dropout
    # 0.2; the guide stopped when val loss reached 3.28, at step 26,100 (--stop_at_val_loss 0 runs on).
    "moe1B": Config(
        model=ModelConfig(model_dimension=768, n_head=12, blocks=8, layers_per_block=6, T=1024, latent_dim=128,
                          q_latent_dim=128, dhR=128, n_experts=16, k=2, n_shared=2, capacity_factor=1.5,
                          dropout_rate=0.2),
        optim=OptimConfig(max_lr=6e-4, min_lr=0.0, end_lr=6e-5, warmup_steps=5_000, end_steps=75_000,
                          training_steps=100_000),
        # 8 micro-batches where the guide has 4: the pipeline bubble 1/9 instead of 1/5 (v4-64: 1.63x ->
        # 1.48x the model's FLOPs; the weights are gathered once a step, so more ticks cost no bytes).
        run=RunConfig(name="moe1B", train_batch_size=32, val_batch_size=256, micro_batch_size=8,
                      checkpoint_steps=100, eval_steps=20, n_device_axis=(8, 2, 2), stop_at_val_loss=3.28)),
}
# The same model and global batch (256 sequences a step) on a v4-32 (16 chips, 4 hosts): half the
# replicas, each with twice the sequences, in 8 micro-batches of 8, the products kept (--remat auto: dots fit;
# docs/launch.md).
PRESETS["moe1B-v4-32"] = dataclasses.replace(
    PRESETS["moe1B"],
    run=dataclasses.replace(PRESETS["moe1B"].run, name="moe1B-v4-32", n_device_axis=(4, 2, 2), train_batch_size=64,
                            val_batch_size=256, micro_batch_size=8))
# The tiny preset in DeepSeek-V3's architecture (every option of docs/model.md's "DeepSeek-V3" on), which
# `python convert.py to-hf` exports to Hugging Face's deepseek_v3 format: gated SiLU FFNs, RMSNorm without
# shift and on both latents, RoPE in every layer, one dense layer before three MoE ones, an untied output
# table, narrower experts, DeepSeek-V3's routed scaling and aux-loss-free bias, and no capacity limit
# (transformers' model drops nothing).
PRESETS["dsv3-tiny"] = dataclasses.replace(
    PRESETS["tiny"], model=dataclasses.replace(
        PRESETS["tiny"].model, ffn="gated_silu", ffn_hidden_dim=128, moe_hidden_dim=64, norm_shift=False,
        latent_norm=True, rope_all_layers=True, first_k_dense=1, blocks=3, layers_per_block=1, n_experts=8,
        tied_embeddings=False, routed_scaling=2.5, capacity_factor=0.0),
    optim=dataclasses.replace(PRESETS["tiny"].optim, bias_update_rate=1e-3),
    run=dataclasses.replace(PRESETS["tiny"].run, name="dsv3-tiny"))
# A 10B MoE (10.5B total, 2.2B active without the embedding) on the guide's v4-64 at its global batch: width
# 2048, 32 experts, blocks of 4 layers. The settings are the cheapest `--compile_for v4-64` finds
# (planning/tradeoffs.py): the routed experts split over dp (each chip keeps its 4 experts whole instead of
# gathering all 32), and the 256 sequences a step in 2 passes of 16 a replica (--grad_step 2), so each pass
# keeps half the activations and the products can be kept (--remat auto, dots on a TPU) rather than
# recomputed: the FLOPs of 4 passes with fewer collective bytes (the plans and the alternatives: docs/launch.md).
PRESETS["moe10B"] = dataclasses.replace(
    PRESETS["moe1B"], model=dataclasses.replace(
        PRESETS["moe1B"].model, model_dimension=2048, n_head=16, n_experts=32, layers_per_block=4, latent_dim=512,
        q_latent_dim=768, dhR=64, expert_parallel=True),
    optim=dataclasses.replace(PRESETS["moe1B"].optim, grad_step=2),
    run=dataclasses.replace(PRESETS["moe1B"].run, name="moe10B", train_batch_size=16))
# One TPU chip of 16 GiB (a v5e-1 VM: README's "One TPU VM"): the moe1B preset's layers at half its depth (4 blocks
# of 6), 8 sequences a step (docs/training.md). The guide's learning rates on a one-chip schedule of 20,000 steps;
# the bundled corpus is for trying it, --data_dir for training. --remat none: the chip holds every layer's
# activations, which the engine then keeps where the forward wrote them, its layers traced apart
# (engine.Fast.layer_loop): nothing replayed and nothing stacked, where full replays every layer and auto's dots
# has the layer scans stack the kept products (docs/performance-log.md#2026-12-07-tpu-layers-apart).
PRESETS["moe1B-v5e-1"] = dataclasses.replace(
    PRESETS["moe1B"], model=dataclasses.replace(PRESETS["moe1B"].model, blocks=4, remat="none"),
    optim=dataclasses.replace(PRESETS["moe1B"].optim, warmup_steps=200, end_steps=20_000, training_steps=20_000),
    run=dataclasses.replace(PRESETS["moe1B"].run, name="moe1B-v5e-1", n_device_axis=(1, 1, 1), train_batch_size=8,
                            val_batch_size=8, micro_batch_size=1, stop_at_val_loss=0.0))
PRESET_SLICES = {"moe1B": "v4-64", "moe1B-v4-32": "v4-32", "moe10B": "v4-64", "moe1B-v5e-1": "v5e-1"}  # the TPU slice each preset's mesh fills
# The guide's run on FineWeb-Edu: these presets train on --data_dir, never on the bundled corpus.
FINEWEB_PRESETS = ("moe1B", "moe1B-v4-32", "moe10B")
TOKENIZE_FINEWEB = ("python -m data.tokenize_local --source HuggingFaceFW/fineweb-edu --hf_config sample-350BT "
                    "--out gs://BUCKET/fineweb-edu --shard_size 100000000 --val_shards 1 --max_tokens 26400000000")

# Flags that pick an implementation, and their values: the keys of engine.REMAT_POLICIES (with none:
# nothing recomputed), of expert_kernels.MOE_IMPLS and of engine.ENGINES (tests/test_config.py checks they agree).
CHOICES = {"remat": ("auto", "full", "dots", "none"), "fsdp_gather": ("step", "tick"), "moe_impl": ("buffers", "ragged"),
           "engine": ("fast", "reference"), "ffn": ("gelu", "gated_silu")}

SECTIONS = {"model": ModelConfig, "optim": OptimConfig, "run": RunConfig, "inference": InferenceConfig}


def _parse_bool(text):
    if text.lower() in ("1", "true", "yes"):
        return True
    if text.lower() in ("0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _preset_values(section, name):
    """A field's value in each preset, for --help: "tiny: 64, moe1B: 768, ..." or "every preset: 0.9"."""
    shown = {p: getattr(getattr(cfg, section), name) for p, cfg in PRESETS.items()}
    shown = {p: " ".join(map(str, v)) if isinstance(v, tuple) else repr(v) if isinstance(v, str) else v
             for p, v in shown.items()}
    if len(set(map(repr, shown.values()))) == 1:
        return f"every preset: {next(iter(shown.values()))}"
    return ", ".join(f"{p}: {v}" for p, v in shown.items())


class _Parser(argparse.ArgumentParser):
    """argparse, whose mistakes are one line (not the 30-line usage first) with the closest flag names."""

    def error(self, message):
        unknown = message.split(": ", 1)[1].split() if message.startswith("unrecognized arguments") else []
        flags = [f for action in self._actions for f in action.option_strings]
        close = [m for arg in unknown if arg.startswith("-")
                 for m in difflib.get_close_matches(arg.split("=")[0], flags, 1, 0.6)]
        self.exit(2, f"{self.prog}: error: {message}" + (f" (did you mean {', '.join(close)}?)" if close else "")
                  + f"; python {self.prog} --help lists every flag\n")


# The commands a newcomer needs, at the end of --help (tests/test_config.py parses each).
EXAMPLES = (
    ("python main.py", "train the tiny preset on the bundled corpus into runs/tiny"),
    ("python main.py --name tiny --sample --prompt 'And God said'", "a sample from runs/tiny's newest checkpoint"),
    ("python main.py --name tiny --evaluate --eval_tasks kjv_endings,olmo_piqa",
     "val loss and task scores of that checkpoint"),
    ("python plot.py runs/tiny", "its figures: loss, tasks, balance, expert load"),
    ("python main.py --preset moe1B --compile_for v4-64", "will it fit a TPU slice? (compiled here, no TPU)"),
)


def build_parser():
    """The CLI: --preset, then one flag per config field, named as the field, with its help text."""
    parser = _Parser(
        usage="python main.py [--preset NAME] [--FLAG VALUE ...]",
        description="Train, evaluate and sample a sharded MoE + MLA transformer. With no flags: the tiny "
                    "preset on the bundled corpus.",
        epilog="examples:\n" + "\n".join(f"  {command}\n      {what}" for command, what in EXAMPLES),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                        help="starting configuration; every other flag overrides one of its fields. Pod presets "
                             "and their TPU slices: " + ", ".join(f"{p} on {s}" for p, s in PRESET_SLICES.items())
                             + " (default: tiny)")
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(section)
        for f in dataclasses.fields(cls):
            kwargs = {"default": None, "help": f"{f.metadata['help']} ({_preset_values(section, f.name)})",
                      "choices": CHOICES.get(f.name)}
            if f.name == "n_device_axis":
                kwargs.update(nargs=3, type=int, metavar=("DP", "PP", "TP"))
            elif f.type is bool or f.type == "bool":
                kwargs.update(type=_parse_bool, nargs="?", const=True, metavar="BOOL")
            else:
                kwargs["type"] = {"int": int, "float": float, "str": str}.get(f.type, f.type)
            group.add_argument(f"--{f.name}", **kwargs)
    return parser


def _mesh_hint(cfg, n_devices):
    """What to pass for a mesh that does not fit: on a --compile_for slice, this preset's version made for it
    and the mesh with this PP and TP that fills it; on a CPU, enough simulated devices."""
    r, dims = cfg.run, cfg.run.dims
    if r.compile_for:
        fixes = [f"--preset {p}" for p, s in PRESET_SLICES.items()
                 if s == r.compile_for.strip().lower() and p.startswith(f"{cfg.preset}-")]
        if n_devices % dims.stage_plane == 0:
            fixes.append(_same_batch_on(cfg, n_devices // dims.stage_plane))
        return f" (for {r.compile_for}: {' or '.join(fixes)})" if fixes else ""
    return "" if r.cpu_devices else f" (to try this mesh on a CPU: --cpu_devices {dims.n_devices})"


def _same_batch_on(cfg, dp):
    """The flags for cfg's pp and tp with `dp` replicas and the same sequences per optimizer step: more passes
    (--grad_step) where fewer replicas each keep their --train_batch_size, else a larger one; or the step's new
    size said where neither divides."""
    mesh, per_replica, grad_step = cfg.run.dims.replace(dp=dp).flags, cfg.run.train_batch_size, cfg.optim.grad_step
    sequences = sequences_per_step(cfg)
    if sequences % (dp * per_replica) == 0:
        passes = sequences // (dp * per_replica)
        return mesh + (f" --grad_step {passes}" if passes != grad_step else "")
    if sequences % (dp * grad_step) == 0:
        return mesh + f" --train_batch_size {sequences // (dp * grad_step)}"
    return mesh + f" (a step of {dp * per_replica * grad_step} sequences, not {sequences})"


def config_from_args(argv=None):
    """Parse the CLI into a Config: the preset, then every flag given on top of it."""
    args = vars(build_parser().parse_args(argv))
    preset = args.pop("preset")
    return override(dataclasses.replace(PRESETS[preset], preset=preset), **{k: v for k, v in args.items() if v is not None})


def override(cfg, **values):
    """A copy of cfg with fields replaced by name, whichever section they live in."""
    sections = {}
    for name, value in values.items():
        owner = [s for s, cls in SECTIONS.items() if name in {f.name for f in dataclasses.fields(cls)}]
        if not owner:
            raise ValueError(f"unknown config field {name!r}")
        sections.setdefault(owner[0], {})[name] = tuple(value) if name == "n_device_axis" else value
    return dataclasses.replace(cfg, **{s: dataclasses.replace(getattr(cfg, s), **v) for s, v in sections.items()})


class ConfigError(ValueError):
    """One or more invalid settings; the message lists every violated rule."""


def _divides(errors, size, size_flag, by, by_flag):
    if by > 0 and size % by:
        errors.append(f"{size_flag} ({size}) must be divisible by {by_flag} ({by}); valid values of {size_flag} "
                      f"are multiples of {by}")


def _at_least(errors, value, flag, low):
    if value < low:
        errors.append(f"{flag} must be >= {low}, got {value}")


SEED_LIMIT = 2**31 - 1       # seeds and seed + 1 fit in an int32 (jax.random.key, the data order, samples)


def validate(cfg, n_devices=None):
    """Raise ConfigError listing every violated rule (with flag names and valid values); return cfg."""
    m, o, r, i = cfg.model, cfg.optim, cfg.run, cfg.inference
    errors = []
    # nan and inf pass every `value < low` test below (nan compares false): refuse them first, by name.
    nonfinite = [f"--{f.name}" for section in (m, o, r, i) for f in dataclasses.fields(section)
                 if isinstance(getattr(section, f.name), float) and not math.isfinite(getattr(section, f.name))]
    if nonfinite:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(
            f"{flag} must be a finite number, got {_field(cfg, flag)}" for flag in nonfinite))
    errors += ParallelDims.shape_errors(r.n_device_axis)
    dims = r.dims
    dp, pp, tp, fsdp = dims.dp, dims.pp, dims.tp, dims.fsdp_per_slice
    for flag, value, low in [("--model_dimension", m.model_dimension, 1), ("--n_head", m.n_head, 1),
                             ("--blocks", m.blocks, 1), ("--layers_per_block", m.layers_per_block, 1),
                             ("--T", m.T, 2), ("--latent_dim", m.latent_dim, 1),
                             ("--q_latent_dim", m.q_latent_dim, 1), ("--dhR", m.dhR, 2),
                             ("--n_experts", m.n_experts, 1), ("--k", m.k, 1), ("--n_shared", m.n_shared, 0),
                             ("--capacity_factor", m.capacity_factor, 0), ("--alpha", m.alpha, 0),
                             ("--vocab_size", m.vocab_size, 2), ("--train_batch_size", r.train_batch_size, 1),
                             ("--val_batch_size", r.val_batch_size, 1), ("--micro_batch_size", r.micro_batch_size, 1),
                             ("--grad_step", o.grad_step, 1), ("--training_steps", o.training_steps, 1),
                             ("--warmup_steps", o.warmup_steps, 0), ("--end_steps", o.end_steps, 1),
                             ("--checkpoint_steps", r.checkpoint_steps, 1), ("--eval_steps", r.eval_steps, 1),
                             ("--min_lr", o.min_lr, 0), ("--end_lr", o.end_lr, 0), ("--weight_decay", o.weight_decay, 0),
                             ("--bias_update_rate", o.bias_update_rate, 0),
                             ("--stop_at_val_loss", r.stop_at_val_loss, 0),
                             ("--top_k", i.top_k, 1), ("--max_tokens", i.max_tokens, 0),
                             ("--cpu_devices", r.cpu_devices, 0), ("--pipeline_repeats", m.pipeline_repeats, 1),
                             ("--max_bad_steps", r.max_bad_steps, 1), ("--hang_timeout", r.hang_timeout, 0),
                             ("--first_k_dense", m.first_k_dense, 0), ("--ffn_hidden_dim", m.ffn_hidden_dim, 0),
                             ("--moe_hidden_dim", m.moe_hidden_dim, 0), ("--qk_head_dim", m.qk_head_dim, 0),
                             ("--v_head_dim", m.v_head_dim, 0), ("--eval_tasks_limit", r.eval_tasks_limit, 0),
                             ("--step", r.step, 0)]:
        _at_least(errors, value, flag, low)
    if not 0 <= r.seed < SEED_LIMIT:
        errors.append(f"--seed must be in [0, {SEED_LIMIT - 1}], got {r.seed}")
    if r.sample and r.evaluate:
        errors.append("--sample and --evaluate are two modes of their own: pass one")
    if r.step and not (r.sample or r.evaluate):
        errors.append(f"--step {r.step} names the checkpoint that --evaluate or --sample reads: pass one of them "
                      f"(training resumes from the newest)")
    if not _plain_name(r.name):
        errors.append(f"--name must be one directory name under --output_dir (letters, digits, '.', '-', '_'; not "
                      f"empty, '.' or '..', no '/'), got {r.name!r}")
    if not o.embed_eps > 0:
        errors.append(f"--embed_eps must be > 0 (the table's padding rows have zero gradient), got {o.embed_eps}")
    for flag, value in [("--max_lr", o.max_lr), ("--grad_clip_norm", o.grad_clip_norm),
                        ("--temperature", i.temperature), ("--rope_base", m.rope_base),
                        ("--routed_scaling", m.routed_scaling)]:
        if not value > 0:
            errors.append(f"{flag} must be > 0, got {value}")
    if o.skip_spikes != 0 and not o.skip_spikes > 1:
        errors.append(f"--skip_spikes must be 0 (off) or a factor > 1 (e.g. 5), got {o.skip_spikes}")
    if not 0 <= m.dropout_rate < 1:
        errors.append(f"--dropout_rate must be in [0, 1), got {m.dropout_rate}")
    if not (0 <= o.b1 < 1 and 0 <= o.b2 < 1):
        errors.append(f"--b1 and --b2 must be in [0, 1), got {o.b1}, {o.b2}")
    if m.model_dtype not in ("bfloat16", "float32"):
        errors.append(f"--model_dtype must be bfloat16 or float32, got {m.model_dtype!r}")
    for name in ("remat", "fsdp_gather", "moe_impl", "engine", "ffn"):
        value = getattr(m, name)
        choices = CHOICES[name]
        if value not in choices:
            errors.append(f"--{name} must be {', '.join(choices[:-1])} or {choices[-1]}, got {value!r}")
    if m.n_experts >= 1 and m.k > m.n_experts:
        errors.append(f"--k ({m.k}) must be <= --n_experts ({m.n_experts}); valid values are 1..{m.n_experts}")
    if m.dhR % 2:
        errors.append(f"--dhR ({m.dhR}) must be even: RoPE rotates pairs of channels")
    if not m.qk_head_dim:                                 # the head width is D / H
        _divides(errors, m.model_dimension, "--model_dimension", m.n_head, "--n_head")
    _divides(errors, m.n_head, "--n_head", tp, TP)
    _divides(errors, m.ffn_dim, "--ffn_hidden_dim" if m.ffn_hidden_dim else "4 x --model_dimension (the FFN width)",
             tp, TP)
    if m.moe_hidden_dim:
        _divides(errors, m.moe_hidden_dim, "--moe_hidden_dim", tp, TP)
    _divides(errors, m.padded_vocab, f"--vocab_size padded to a multiple of {VOCAB_PAD_MULTIPLE}", tp, TP)
    errors += dims.rule_errors()
    # FSDP shards the weights over the dp replicas of one slice
    shards = dims.fsdp_name
    _divides(errors, m.model_dimension, "--model_dimension", fsdp, f"{shards} (FSDP shards)")
    _divides(errors, m.latent_dim, "--latent_dim", fsdp, f"{shards} (FSDP shards)")
    _divides(errors, m.q_latent_dim, "--q_latent_dim", fsdp, f"{shards} (FSDP shards)")
    _divides(errors, m.blocks, "--blocks", pp, PP)
    if m.expert_parallel:
        _divides(errors, m.n_experts, "--n_experts", fsdp,
                 f"{shards} (--expert_parallel puts E/DP whole experts on each dp shard)")
    _divides(errors, r.micro_batch_size, "--micro_batch_size", pp, PP)
    if m.pipeline_repeats > 1:
        # Stage s holds the groups r PP + s of blocks/(PP R) blocks. The circular schedule also needs
        # M >= PP (a micro-batch back from the last stage must find stage 0 still busy with the others):
        # the rule above (M a multiple of PP, M >= 1) already implies it.
        _divides(errors, m.blocks, "--blocks", pp * m.pipeline_repeats,
                 f"{PP} x --pipeline_repeats ({pp} x {m.pipeline_repeats})")
    _divides(errors, r.train_batch_size, "--train_batch_size", r.micro_batch_size, "--micro_batch_size")
    # a global count: each replica's share of it splits into the micro-batches
    _divides(errors, r.val_batch_size, "--val_batch_size", dp * r.micro_batch_size,
             f"DP x --micro_batch_size ({dp} x {r.micro_batch_size})")
    if o.warmup_steps > o.end_steps:
        errors.append(f"--warmup_steps ({o.warmup_steps}) must be <= --end_steps ({o.end_steps})")
    if m.T >= 2 and i.max_tokens >= m.T:
        errors.append(f"--max_tokens ({i.max_tokens}) must be < --T ({m.T}): the KV cache holds T positions")
    n_mesh = dims.n_devices
    if n_devices is not None and (n_mesh > n_devices or n_devices % n_mesh):
        slices = [t.name for t in hardware.tpu_slices() if t.chips == n_mesh]
        errors.append(f"{dims.flags} needs {n_mesh} devices"
                      + (f" (a TPU {' or '.join(slices)})" if slices else "")
                      + f", which must divide the {n_devices} available; valid meshes have DP x PP x TP "
                        f"dividing {n_devices}" + _mesh_hint(cfg, n_devices))
    if errors:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(errors))
    return cfg


def check_slices(cfg, n_processes, slices_found):
    """Raise ConfigError unless --n_slices fits the job's processes and devices: each slice whole processes
    (hosts), and on TPUs joined by megascale (slices_found > 1: their devices' slice_index) one slice each."""
    n = cfg.run.n_slices
    if slices_found > 1 and n != slices_found:
        raise ConfigError(f"invalid configuration:\n  - --n_slices ({n}) must be {slices_found}: these devices are "
                          f"{slices_found} TPU slices (their slice_index), joined over DCN")
    if n_processes > 1 and n_processes % n:
        raise ConfigError(f"invalid configuration:\n  - --n_slices ({n}) must divide the {n_processes} processes (a "
                          f"slice is whole hosts); valid values divide {n_processes}")
    return cfg


def _field(cfg, flag):
    """The value of the field a --flag names."""
    name = flag.lstrip("-")
    return next(getattr(getattr(cfg, s), name) for s in SECTIONS if hasattr(getattr(cfg, s), name))


def _plain_name(name):
    """A run name is one path component: RUN_DIR = OUTPUT_DIR/NAME, never a path outside OUTPUT_DIR."""
    return name not in ("", ".", "..") and all(c.isalnum() or c in "._-" for c in name)


def config_lines(cfg):
    """A few lines summarising the run, for the log."""
    lines = [f"   preset: {cfg.preset}"]
    for section in SECTIONS:
        values = dataclasses.asdict(getattr(cfg, section))
        lines.append(f"{section:>9}: " + " ".join(f"{k}={v}" for k, v in values.items()))
    return "\n".join(lines)


def global_batch(cfg):
    """Sequences per micro-step over every data-parallel replica: DP x --train_batch_size (the guide's
    --train_batch_size is per replica)."""
    return cfg.run.dims.dp * cfg.run.train_batch_size


def sequences_per_step(cfg):
    """Sequences per optimizer step: --grad_step micro-steps of the global batch."""
    return cfg.optim.grad_step * global_batch(cfg)
