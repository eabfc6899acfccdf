"""The training driver: mesh, init or restore, train/eval steps, logging, checkpoints, sampling.

`python main.py` with no flags trains the `tiny` preset on the bundled corpus (tokenized once into
$JAXFORMER_CACHE, default ~/.cache/jaxformer) on whatever devices exist; every field of the config is a flag (`python main.py --help`).
A run lives in OUTPUT_DIR/NAME (`--output_dir`, `--name`): checkpoints/, metrics.jsonl, samples.txt
and, with `--wandb`, the wandb files. Starting the same command again resumes from the newest
readable checkpoint, exactly: the data loader is a pure function of the step, and the RNG key, the
optimizer state and the step are in the checkpoint.

Steps are counted in optimizer updates; "step k" is the k-th update, and its loss is the loss of the
batch that update was computed from. Each update averages the gradients of `--grad_step`
micro-steps of DP x `--train_batch_size` sequences each (loader index = step * grad_step + i).

Test hooks (environment, used by tests/test_main.py only):
  JAXFORMER_TEST_SIGNAL=STEP:SIG   send signal SIG (KILL or TERM) to this process after step STEP
                                   (after that step's checkpoint, if one is due, has been written).
  JAXFORMER_NO_SAMPLES=1           skip text generation (saves compile time in tests).
"""
import dataclasses
import json
import os
import signal
import sys
import time
import uuid
import warnings

import multihost
import utils

REPO = os.path.dirname(os.path.abspath(__file__))


def log(*args, **kwargs):
    """Print on process 0 only (every host runs this same script)."""
    if _PROCESS_INDEX == 0:
        print(*args, **kwargs, flush=True)


_PROCESS_INDEX = 0


def set_up_devices(cfg):
    """Environment for JAX, which must happen before `import jax`; then multi-host init, which exits
    with one line when not every process joins within $JAXFORMER_INIT_TIMEOUT s. Returns jax."""
    if cfg.run.cpu_devices > 0:
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
        os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={cfg.run.cpu_devices}"])
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    global _PROCESS_INDEX
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        # GPU/CPU clusters (and launcher.sh): the coordinator and this host's rank come from the environment.
        if os.environ.get("JAX_PLATFORMS", "").startswith("cpu"):
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        multihost.initialize(jax, coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
                             num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                             process_id=int(os.environ["JAX_PROCESS_ID"]))
    elif os.environ.get("SLURM_NTASKS", "1") != "1":
        multihost.initialize(jax)         # SLURM: everything is auto-detected
    elif _on_tpu_vm():
        try:                              # TPU pod slices: auto-detected from the TPU metadata
            multihost.initialize(jax)
        except Exception as e:            # a single-host TPU VM needs no coordination
            if _tpu_multihost():
                raise
            warnings.warn(f"jax.distributed.initialize() skipped on a single TPU host: {e}")
    _PROCESS_INDEX = jax.process_index()
    return jax


def _on_tpu_vm():
    import glob
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")
                or os.environ.get("TPU_ACCELERATOR_TYPE") or os.environ.get("TPU_WORKER_HOSTNAMES"))


def _tpu_multihost():
    """True on a TPU VM that is one host of several (TPU_WORKER_HOSTNAMES lists them all)."""
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return len([h for h in hosts.split(",") if h]) > 1


# ----------------------------------------------------------------------------------------------------------
# Metrics sinks: stdout (process 0), metrics.jsonl, wandb


class Logger:
    def __init__(self, cfg, run_dir, run_id, enabled):
        self.enabled = enabled
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.samples_path = os.path.join(run_dir, "samples.txt")
        self.wandb = None
        if enabled and cfg.run.wandb:
            self.wandb = _init_wandb(cfg, run_dir, run_id)

    def metrics(self, record):
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            flat = {}
            for k, v in record.items():
                if k == "expert_load":
                    for layer, loads in enumerate(v):
                        for e, x in enumerate(loads):
                            flat[f"expert_load/layer{layer}/expert{e}"] = x
                elif isinstance(v, (int, float)) and v is not None and k != "step":
                    flat[k] = v
            try:
                self.wandb.log(flat, step=record["step"])
            except Exception as e:                  # a tracker failure never stops training
                warnings.warn(f"wandb.log failed ({e}); continuing with metrics.jsonl only")
                self.wandb = None

    def sample(self, step, prompt, text):
        if not self.enabled:
            return
        with open(self.samples_path, "a") as f:
            f.write(f"=== step {step}\n{prompt}{text}\n\n")
        if self.wandb is not None:
            try:
                import wandb
                self.wandb.log({"sample": wandb.Html(f"<pre>{prompt}{text}</pre>")}, step=step)
            except Exception as e:
                warnings.warn(f"wandb sample logging failed ({e})")

    def close(self):
        if self.wandb is not None:
            try:
                self.wandb.finish()
            except Exception as e:
                warnings.warn(f"wandb.finish failed ({e})")


def _init_wandb(cfg, run_dir, run_id):
    """Online when WANDB_API_KEY is set, otherwise offline files under the run dir; never fatal."""
    try:
        import wandb
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        run = wandb.init(project=os.environ.get("WANDB_PROJECT", "jaxformer"), name=cfg.run.name, id=run_id,
                         resume="allow", dir=run_dir, mode=mode, config=dataclasses.asdict(cfg),
                         settings=wandb.Settings(init_timeout=float(os.environ.get("WANDB_INIT_TIMEOUT", 30)),
                                                 silent=True))
        log(f"wandb: {mode} run {run_id}" + (f" in {run_dir}/wandb" if mode == "offline" else ""))
        return run
    except Exception as e:
        warnings.warn(f"wandb could not start ({type(e).__name__}: {e}); continuing with metrics.jsonl only")
        return None


# ----------------------------------------------------------------------------------------------------------
# Checkpoints


def checkpoint_manager(run_dir):
    import orbax.checkpoint as ocp
    options = ocp.CheckpointManagerOptions(max_to_keep=3, enable_async_checkpointing=True, create=True)
    return ocp.CheckpointManager(os.path.join(os.path.abspath(run_dir), "checkpoints"), options=options,
                                 item_names=("state", "meta"))


def save(mngr, step, state, meta, force=False):
    import orbax.checkpoint as ocp
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
              force=force)


def restore_latest(mngr, abstract_state, run_dir):
    """(state, meta) from the newest readable checkpoint, restored straight onto the current mesh's
    shardings (so a checkpoint saved on any mesh restores on this one); None when there is none.
    An unreadable checkpoint is moved aside to run_dir/unreadable_checkpoints with a warning."""
    import jax
    import orbax.checkpoint as ocp
    for step in sorted(mngr.all_steps(), reverse=True):
        try:
            restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                                                    meta=ocp.args.JsonRestore()))
            state, meta = restored["state"], restored["meta"]
            if int(meta["step"]) != step:
                raise ValueError(f"metadata says step {meta['step']}")
            return state, meta
        except Exception as e:
            msg = str(e).strip().splitlines()
            warnings.warn(f"checkpoint at step {step} is unreadable ({type(e).__name__}: "
                          f"{msg[0][:300] if msg else ''}); falling back to the previous one", stacklevel=2)
            log(f"WARNING: checkpoint at step {step} is unreadable; falling back to the previous one")
            if jax.process_index() == 0:
                src = os.path.join(str(mngr.directory), str(step))
                dst_dir = os.path.join(run_dir, "unreadable_checkpoints")
                os.makedirs(dst_dir, exist_ok=True)
                if os.path.exists(src):
                    os.replace(src, os.path.join(dst_dir, f"{step}-{int(time.time())}"))
            mngr.reload()
    return None


# ----------------------------------------------------------------------------------------------------------
# Data


def data_dir_for(cfg):
    if cfg.run.data_dir:
        return cfg.run.data_dir
    import dataset
    return dataset.ensure_bundled_shards(dataset.default_cache_dir())


def unigram_entropy(data_dir, train_ds, vocab_size):
    """Entropy (nats) of the training tokens' unigram distribution: the loss of the best model that
    ignores context. Cached next to the shards when the directory is local."""
    import numpy as np
    cache = os.path.join(data_dir, "unigram_entropy.json") if "://" not in data_dir else None
    if cache and os.path.exists(cache):
        with open(cache) as f:
            return json.load(f)["nats"]
    counts = np.zeros(vocab_size, np.int64)
    for chunk in _token_chunks(train_ds):
        counts += np.bincount(np.asarray(chunk, np.int64), minlength=vocab_size)[:vocab_size]
    p = counts[counts > 0] / counts.sum()
    nats = float(-(p * np.log(p)).sum())
    if cache and _PROCESS_INDEX == 0:
        try:
            with open(cache, "w") as f:
                json.dump({"nats": nats, "tokens": int(counts.sum())}, f)
        except OSError:
            pass
    return nats


def _token_chunks(ds):
    """The token arrays behind a TokenDataset, whatever it calls them."""
    for name in ("tokens", "shards", "arrays"):
        value = getattr(ds, name, None)
        if value is None:
            continue
        if hasattr(value, "shape"):
            yield value
        else:
            yield from value
        return
    raise AttributeError("TokenDataset exposes no token arrays (tokens/shards/arrays)")


# ----------------------------------------------------------------------------------------------------------
# The run


def main(argv=None):
    cfg = utils.config_from_args(argv)
    jax = set_up_devices(cfg)
    n_devices = jax.device_count()
    try:
        utils.validate(cfg, n_devices)
    except utils.ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    return train(cfg, jax)


def build_trainer(cfg, mesh):
    """The training state's shardings, a fresh state, and the jitted training step (bench.py times
    this same step). step(params, opt_state, key, xs, ys) -> (params, opt_state, key, stats); xs and ys
    are tuples of --grad_step global batches [dp x train_batch_size, T] laid out as data_sharding."""
    import types

    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import model

    mc, oc, rc = cfg.model, cfg.optim, cfg.run
    abstract_params = jax.eval_shape(lambda k: model.init_params(mc, k), jax.random.key(0))
    p_shard = model.param_shardings(abstract_params, mesh)
    replicated = NamedSharding(mesh, P())
    schedule = utils.lr_schedule(oc)
    optimizer = optax.chain(
        optax.clip_by_global_norm(oc.grad_clip_norm),
        optax.adamw(schedule, b1=oc.b1, b2=oc.b2, weight_decay=oc.weight_decay,
                    mask=model.decay_mask(abstract_params)))
    abstract_opt = jax.eval_shape(optimizer.init, abstract_params)
    o_shard = optax.tree_map_params(optimizer, lambda _, s: s, abstract_opt, p_shard,
                                    transform_non_params=lambda _: replicated)
    state_shard = {"params": p_shard, "opt_state": o_shard, "key": replicated}

    def fresh_state(seed):
        init_key, train_key = jax.random.split(jax.random.key(seed))
        params = jax.jit(lambda k: model.init_params(mc, k), out_shardings=p_shard)(init_key)
        opt_state = jax.jit(optimizer.init, out_shardings=o_shard)(params)
        # The key committed to the mesh like the train step's output, so step 2 reuses step 1's executable.
        return {"params": params, "opt_state": opt_state,
                "key": jax.device_put(jax.random.key_data(train_key), replicated)}

    abstract_state = {"params": abstract_params, "opt_state": abstract_opt,
                      "key": jax.ShapeDtypeStruct(jax.random.key_data(jax.random.key(0)).shape, jnp.uint32)}
    abstract_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                  abstract_state, state_shard)
    G, M = oc.grad_step, rc.micro_batch_size

    def train_step(params, opt_state, key, xs, ys):
        key, step_key = jax.random.split(jax.random.wrap_key_data(key))
        grad_fn = jax.value_and_grad(
            lambda p, x, y, k: model.loss_and_metrics(p, x, y, k, mc, mesh, M, True), has_aux=True)

        def micro(carry, inputs):
            grads, stats = carry
            x, y, i = inputs
            (loss, metrics), g = grad_fn(params, x, y, jax.random.fold_in(step_key, i))
            grads = jax.tree.map(jnp.add, grads, g)
            new = {"loss": loss, "ce": metrics["ce"], "balance": metrics["balance"],
                   "drop_rate": metrics["drop_rate"], "expert_load": metrics["expert_load"]}
            stats = jax.tree.map(jnp.add, stats, new)
            return (grads, stats), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        n_moe = jax.eval_shape(grad_fn, params, xs[0], ys[0], step_key)[0][1]["expert_load"].shape
        stats0 = {"loss": 0.0, "ce": 0.0, "balance": 0.0, "drop_rate": 0.0, "expert_load": jnp.zeros(n_moe)}
        stats0 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), stats0)
        if G == 1:
            (grads, stats), _ = micro((zeros, stats0), (xs[0], ys[0], 0))
        else:
            (grads, stats), _ = jax.lax.scan(micro, (zeros, stats0), (jnp.stack(xs), jnp.stack(ys), jnp.arange(G)))
            grads = jax.tree.map(lambda g: g / G, grads)
            stats = jax.tree.map(lambda s: s / G, stats)
        stats["grad_norm"] = optax.global_norm(grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, jax.random.key_data(key), stats

    data_sharding = NamedSharding(mesh, P("dp", None))          # sequences over dp, whole rows
    data_shards = tuple([data_sharding] * G)
    train_step = jax.jit(train_step, in_shardings=(p_shard, o_shard, replicated, data_shards, data_shards),
                         out_shardings=(p_shard, o_shard, replicated, replicated), donate_argnums=(0, 1, 2))

    return types.SimpleNamespace(step=train_step, fresh_state=fresh_state, abstract_state=abstract_state,
                                 schedule=schedule, data_sharding=data_sharding)


def train(cfg, jax):
    import model
    return _train(cfg, jax, model.make_mesh(cfg.run.n_device_axis))


def _train(cfg, jax, mesh):
    import numpy as np
    from tqdm import tqdm

    import dataset
    import model
    from data.tokenizer import get_tokenizer

    mc, oc, rc, ic = cfg.model, cfg.optim, cfg.run, cfg.inference
    proc0 = jax.process_index() == 0
    dp, pp, tp = rc.n_device_axis
    n_mesh = dp * pp * tp
    run_dir = os.path.join(rc.output_dir, rc.name)
    if proc0:
        os.makedirs(run_dir, exist_ok=True)

    log(utils.describe(cfg))
    counts = model.count_params(mc)
    log(f"params: total {counts['total']:,} | active {counts['active']:,} | embedding {counts['embedding']:,} "
        f"(active: used per token, without the embedding)")
    log(f"mesh: dp={dp} pp={pp} tp={tp} over {n_mesh} of {jax.device_count()} {jax.devices()[0].device_kind} "
        f"device(s), {jax.process_count()} process(es)")
    log(utils.MFU_FORMULA)

    trainer = build_trainer(cfg, mesh)
    abstract_state, schedule, data_sharding = trainer.abstract_state, trainer.schedule, trainer.data_sharding
    G, M = oc.grad_step, rc.micro_batch_size

    # --- data
    data_dir = data_dir_for(cfg)
    train_ds = dataset.TokenDataset(data_dir, "train", mc.vocab_size)
    val_ds = dataset.TokenDataset(data_dir, "val", mc.vocab_size)
    global_batch = dp * rc.train_batch_size
    val_batches = dataset.validation_batches(val_ds, mc.T, dp * rc.val_batch_size, data_sharding, rc.eval_steps)
    if len(val_batches) < rc.eval_steps:
        log(f"note: the val split holds {val_ds.n_windows(mc.T)} windows of {mc.T + 1} tokens, enough for "
            f"{len(val_batches)} of --eval_steps {rc.eval_steps} batches of {dp * rc.val_batch_size}; "
            f"evaluating on {len(val_batches)}")

    mngr = checkpoint_manager(run_dir)
    restored = restore_latest(mngr, abstract_state, run_dir) if mngr.all_steps() else None
    if restored is None:
        state, start_step, run_id = trainer.fresh_state(rc.seed), 0, uuid.uuid4().hex[:8]
    else:
        state, meta = restored
        start_step, run_id = int(meta["step"]), meta.get("run_id") or uuid.uuid4().hex[:8]
        log(f"resumed from {mngr.directory}/{start_step}: step {start_step}, data position "
            f"{meta['data_step']}, run id {run_id}")
        if meta.get("model") and meta["model"] != dataclasses.asdict(mc):
            log("WARNING: the checkpoint was written with a different model config")

    logger = Logger(cfg, run_dir, run_id, proc0)
    if restored is not None:
        logger.metrics({"event": "resume", "step": start_step})

    @jax.jit
    def eval_step(params, x, y):
        _, metrics = model.loss_and_metrics(params, x, y, jax.random.key(0), mc, mesh, M, False)
        return metrics["ce"], metrics["balance"]

    def evaluate(params):
        results = [eval_step(params, x, y) for x, y in val_batches]
        ce, bal = np.mean([float(r[0]) for r in results]), np.mean([float(r[1]) for r in results])
        return float(ce), float(bal)

    enc = get_tokenizer()
    prompt_ids = enc.encode_ordinary(ic.prompt)
    samples_on = os.environ.get("JAXFORMER_NO_SAMPLES") != "1"
    max_new = min(ic.max_tokens, mc.T - len(prompt_ids))
    if samples_on and max_new < ic.max_tokens:
        log(f"note: prompt ({len(prompt_ids)} tokens) + --max_tokens {ic.max_tokens} exceed --T {mc.T}; "
            f"sampling {max_new} tokens")
    samples_on = samples_on and max_new > 0

    def sample(params, step):
        if not samples_on:
            return
        key = jax.random.fold_in(jax.random.key(rc.seed + 1), step)   # never touches the training key
        new = model.generate(params, mc, prompt_ids, key, max_new, ic.top_k, ic.temperature, ic.use_cache)
        text = enc.decode([t for t in new if t < enc.n_vocab])
        logger.sample(step, ic.prompt, text)
        log(f"sample @ {step}: {ic.prompt}{text!r}")

    def checkpoint(step, state, force=False):
        meta = {"step": step, "data_step": step * G, "run_id": run_id, "model": dataclasses.asdict(mc)}
        save(mngr, step, state, meta, force=force)

    # --- SIGTERM: finish the current step, save, wait, exit 0
    stop = {"requested": False}

    def on_term(signum, frame):
        stop["requested"] = True
    signal.signal(signal.SIGTERM, on_term)
    test_signal = os.environ.get("JAXFORMER_TEST_SIGNAL")
    test_signal = (int(test_signal.split(":")[0]), test_signal.split(":")[1]) if test_signal else None

    # every process stops at the same step; agreed every few seconds, not every step (multihost.py)
    stop_agreed = multihost.StopAgreement(jax, lambda: stop["requested"])

    # --- the loop
    tokens_per_step = G * global_batch * mc.T
    flops_per_token = model.flops_per_token(mc)
    peak = utils.peak_flops(jax.devices()[0].device_kind)
    step = start_step
    loader = dataset.BatchLoader(train_ds, mc.T, global_batch, data_sharding, rc.seed)
    batches = loader.iterate(start_step * G)
    pending = []                       # (step, device metrics) not yet fetched: keeps dispatch one step ahead
    interval = []                      # fetched metrics of the current log interval
    timer = {"t": None, "steps": 0, "first_step_s": None}
    bar = tqdm(total=oc.training_steps, initial=start_step, disable=not proc0, dynamic_ncols=True,
               desc="train", unit="step", file=sys.stdout,
               mininterval=0.5 if sys.stdout.isatty() else 60)    # a log file gets a line a minute
    last_saved = start_step if restored is not None else None
    val_ce = None

    def fetch(upto_all):
        while pending and (upto_all or len(pending) > 1):
            s, m = pending.pop(0)
            m = jax.device_get(m)
            rec = {"step": s, "loss": float(m["loss"]), "ce": float(m["ce"]), "balance": float(m["balance"]),
                   "grad_norm": float(m["grad_norm"]), "lr": float(schedule(s - 1)),
                   "drop_rate": float(m["drop_rate"])}
            logger.metrics(rec)
            interval.append((rec, np.asarray(m["expert_load"])))
            now = time.perf_counter()
            if timer["t"] is None:     # the first step includes compilation: time from its end
                timer["first_step_s"] = now - t_start
                timer["t"], timer["steps"] = now, 0
            else:
                timer["steps"] += 1
            bar.update(1)
            bar.set_postfix(loss=f"{rec['loss']:.3f}", refresh=False)

    t_start = time.perf_counter()
    while step < oc.training_steps:
        xs, ys = zip(*[next(batches) for _ in range(G)])
        params, opt_state, key, metrics = trainer.step(state["params"], state["opt_state"], state["key"], xs, ys)
        state = {"params": params, "opt_state": opt_state, "key": key}
        step += 1
        pending.append((step, metrics))
        if step == start_step + 1:
            print(multihost.started_line(jax), flush=True)     # every process; launcher.sh waits for it
        fetch(upto_all=timer["t"] is None)      # block on the first step, so the timer starts after compilation
        stopping = stop_agreed(step, synced=step % rc.checkpoint_steps == 0 or step == oc.training_steps)
        if step % rc.checkpoint_steps == 0 or step == oc.training_steps or stopping:
            fetch(upto_all=True)
            now = time.perf_counter()
            steps_timed = timer["steps"]
            elapsed = now - timer["t"] if timer["t"] is not None else 0.0
            tok_s = steps_timed * tokens_per_step / elapsed if steps_timed and elapsed > 0 else None
            step_time = elapsed / steps_timed if steps_timed else timer["first_step_s"]
            val_ce, val_bal = evaluate(state["params"])
            recs, loads = [r for r, _ in interval], np.stack([l for _, l in interval])
            load = loads.mean(0)                                     # [n_moe_layers, n_experts]
            spread = float(np.max(load.max(-1) / np.maximum(load.min(-1), 1e-12)))
            util = utils.mfu(tok_s, flops_per_token, n_mesh, peak) if tok_s else None
            rec = {"step": step, "val_loss": val_ce, "val_balance": val_bal,
                   "train_loss": float(np.mean([r["loss"] for r in recs])), "lr": recs[-1]["lr"],
                   "grad_norm": recs[-1]["grad_norm"], "tokens_per_s": tok_s, "step_time_s": step_time,
                   "mfu": util, "expert_load": load.tolist(), "expert_load_spread": spread,
                   "drop_rate": float(np.mean([r["drop_rate"] for r in recs])),
                   "balance": float(np.mean([r["balance"] for r in recs]))}
            logger.metrics(rec)
            bar.write(f"step {step:>6} | loss {recs[-1]['loss']:.4f} | val {val_ce:.4f} | lr {rec['lr']:.2e} | "
                      f"grad {rec['grad_norm']:.3f} | "
                      f"{(f'{tok_s:,.0f}' if tok_s else 'n/a'):>8} tok/s | step {step_time * 1e3:.0f} ms | "
                      f"MFU {(f'{100 * util:.1f}%' if util is not None else 'n/a')} | "
                      f"load max/min {spread:.2f} | drop {100 * rec['drop_rate']:.2f}%") if proc0 else None
            sample(state["params"], step)
            interval.clear()
            if step % (10 * rc.checkpoint_steps) == 0 or step == oc.training_steps or stopping:
                checkpoint(step, state, force=stopping)
                last_saved = step
            timer["t"], timer["steps"] = time.perf_counter(), 0
        if test_signal and step == test_signal[0]:
            mngr.wait_until_finished()
            fetch(upto_all=True)
            os.kill(os.getpid(), getattr(signal, "SIG" + test_signal[1]))
            if test_signal[1] == "TERM":
                stop["requested"] = True    # make sure the handler's flag is seen at the next check
        if stopping:
            break
    fetch(upto_all=True)
    bar.close()
    if stop["requested"] and step < oc.training_steps:
        mngr.wait_until_finished()
        mngr.close()
        log(f"SIGTERM: checkpoint written at step {step}; exiting")
        logger.close()
        loader.close()
        return 0

    if val_ce is None:                          # resumed a finished run: just report
        val_ce, _ = evaluate(state["params"])
        sample(state["params"], step)
    if last_saved != step:
        checkpoint(step, state)
    mngr.wait_until_finished()
    mngr.close()
    entropy = unigram_entropy(data_dir, train_ds, mc.vocab_size)
    log(f"final: val cross-entropy {val_ce:.4f} nats | unigram entropy of the training tokens {entropy:.4f} nats "
        f"| {entropy - val_ce:+.4f} nats below it | {time.perf_counter() - t_start:.0f} s")
    logger.metrics({"step": step, "final_val_loss": val_ce, "unigram_entropy": entropy})
    logger.close()
    loader.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
