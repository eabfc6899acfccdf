"""The small model the tests compile, in one place: the tiny preset shrunk until a compile takes seconds.

- `SMALL_FLAGS`: main.py's flags for it (width 32, 2 heads, latents 16, rotary width 8; the tiny preset's 2
  blocks of 2 layers, the second of each MoE with 4 experts, top-2); each test adds what it is about
  (run_util.TINY_FLAGS, test_bench's SMALL, test_fit's).
- `small_model(**changes)`: the same model as a ModelConfig, for the tests that build it themselves, at
  vocabulary 300 and T 16 (model_util.CFG, test_spikes' SPIKE_MODEL, test_pod's ragged experts)."""
import dataclasses

import utils

SMALL_FLAGS = ("--model_dimension 32 --n_head 2 --blocks 2 --layers_per_block 2 --T 32 --latent_dim 16 "
               "--q_latent_dim 16 --dhR 8 --n_experts 4 --k 2").split()


def small_model(**changes):
    return dataclasses.replace(utils.config_from_args(SMALL_FLAGS).model, **{"vocab_size": 300, "T": 16, **changes})
