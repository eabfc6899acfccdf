"""Generation with the latent KV cache: one jitted scan over positions, top-k and temperature
sampling; the cache holds only the KV latent c_kv and the rotated shared key (plus each MoE layer's
per-expert fill count, so cached decode keeps and drops exactly what the full forward does). `generate`
samples from params; `compile_sampler` compiles a training run's whole draw from its state ahead.
"""
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from collectives import Axes
from engine import engine_for, matmul_precision
from model import output_logits
from sharding import build, model_order, with_router_bias


def init_caches(cfg, batch, length, dtype=jnp.float32):
    """Per layer, stacked like the params: the attention cache (the KV latent, plus the rotated shared key
    in RoPE layers) and in MoE layers each sequence's tokens queued per expert so far."""
    def attention(*lead, rope=True):
        cache = {"c_kv": jnp.zeros((*lead, batch, length, cfg.latent_dim), dtype)}
        return cache | ({"k_rope": jnp.zeros((*lead, batch, length, cfg.dhR), dtype)} if rope else {})
    n_dense = cfg.layers_per_block - 1
    blocks = {"moe": {"attn": attention(cfg.blocks, rope=cfg.rope_all_layers),
                      "expert_fill": jnp.zeros((cfg.blocks, batch, cfg.n_experts), jnp.int32)}}
    if n_dense:
        blocks["dense"] = {"attn": attention(cfg.blocks, n_dense)}
    caches = {"blocks": blocks}
    if cfg.first_k_dense:
        caches["prologue"] = {"attn": attention(cfg.first_k_dense)}
    return caches


def _sample(logits_V, key, top_k, temperature):
    values, ids = lax.top_k(logits_V / temperature, top_k)
    return ids[jax.random.categorical(key, values)]


@partial(jax.jit, static_argnames=("cfg", "n_total", "top_k", "use_cache"))
def _decode(params, cfg, tokens_T, n_prompt, key, n_total, top_k, temperature, use_cache):
    """Fill tokens_T[n_prompt:n_total] one position at a time. Returns tokens and the fp32 logits
    (real vocab) that chose each position. The cached path feeds one token per step; the uncached
    path recomputes the whole prefix each step. Both draw position p with fold_in(key, p)."""
    transformer, axes = build(params, cfg), Axes(engine=engine_for(cfg))
    T = tokens_T.shape[0]

    def logits_at(h_D):
        table_vD = transformer.output_table(axes, transformer.embed.gathered(axes))
        return output_logits(h_D[None, None], table_vD, cfg, axes)[0, 0, :cfg.vocab_size]

    def step(carry, p):
        tokens_T, caches = carry
        if use_cache:
            h_1TD, _, caches = transformer(tokens_T[p][None, None], axes, positions_T=p[None], caches=caches)
            logits_V = logits_at(h_1TD[0, 0])
        else:
            h_1TD, _, _ = transformer(tokens_T[None], axes)
            logits_V = logits_at(h_1TD[0, p])
        chosen = _sample(logits_V, jax.random.fold_in(key, p + 1), top_k, temperature)
        write = p + 1 >= n_prompt
        tokens_T = tokens_T.at[p + 1].set(jnp.where(write, chosen, tokens_T[p + 1]))
        return (tokens_T, caches), logits_V

    caches = init_caches(cfg, 1, T) if use_cache else None
    with matmul_precision(cfg.model_dtype):
        (tokens_T, _), logits_PV = lax.scan(step, (tokens_T, caches), jnp.arange(n_total - 1))
    return tokens_T, logits_PV


def prompt_tokens(prompt_ids, max_tokens, T):
    """The decode's tokens [T]: the prompt, then zeros; ValueError unless the prompt plus max_tokens fit in T."""
    n_prompt = len(prompt_ids)
    if n_prompt < 1 or n_prompt + max_tokens > T:
        raise ValueError(f"prompt ({n_prompt} tokens) + --max_tokens ({max_tokens}) must be between 1 and --T "
                         f"({T}); shorten --prompt or lower --max_tokens")
    tokens_T = np.zeros(T, np.int32)
    tokens_T[:n_prompt] = prompt_ids
    return tokens_T


def generate(params, cfg, prompt_ids, key, max_tokens, top_k, temperature, use_cache=True, return_logits=False):
    """Sample max_tokens new ids after prompt_ids (top-k, temperature); the prompt plus the new tokens
    must fit in the context T. Returns the new ids (and the logits that chose them)."""
    n_prompt = len(prompt_ids)
    tokens_T, logits_PV = _decode(model_order(params), cfg, prompt_tokens(prompt_ids, max_tokens, cfg.T), n_prompt,
                                  key, n_prompt + max_tokens, min(top_k, cfg.vocab_size), temperature, use_cache)
    new = [int(t) for t in np.asarray(tokens_T)[n_prompt:n_prompt + max_tokens]]
    return (new, logits_PV[n_prompt - 1:]) if return_logits else new


def compile_sampler(abstract_state, cfg, prompt_ids, seed, max_tokens, top_k, temperature, use_cache=True):
    """sample(state, step) -> max_tokens new ids after prompt_ids (top-k, temperature) from a training state's
    params, drawn with the key fold_in(key(seed), step). The whole draw (the key, the params in model order with
    the routing bias beside the routers, the decode) is one program, compiled now for the state's shapes and
    shardings (abstract_state), so that a sample compiles nothing: a stop during one waits for no compile."""
    n_prompt, tokens_T = len(prompt_ids), prompt_tokens(prompt_ids, max_tokens, cfg.T)
    draw = partial(_draw, cfg=cfg, seed=seed, n_prompt=n_prompt, n_total=n_prompt + max_tokens,
                   top_k=min(top_k, cfg.vocab_size), use_cache=use_cache)
    program = jax.jit(draw).lower(abstract_state["params"], abstract_state["router_bias"],
                                  jax.ShapeDtypeStruct(tokens_T.shape, jnp.int32), jax.ShapeDtypeStruct((), jnp.int32),
                                  jax.ShapeDtypeStruct((), jnp.float32)).compile()

    def sample(state, step):
        drawn_T = np.asarray(program(state["params"], state["router_bias"], tokens_T, step, temperature))
        return [int(t) for t in drawn_T[n_prompt:n_prompt + max_tokens]]
    return sample


def _draw(params, router_bias, tokens_T, step, temperature, *, cfg, seed, n_prompt, n_total, top_k, use_cache):
    """compile_sampler's program: tokens_T with positions [n_prompt, n_total) drawn."""
    key = jax.random.fold_in(jax.random.key(seed), step)
    params = model_order(with_router_bias(params, router_bias))
    return _decode(params, cfg, tokens_T, n_prompt, key, n_total, top_k, temperature, use_cache)[0]
