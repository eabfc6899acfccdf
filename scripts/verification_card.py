"""The Hugging Face verification card: docs/verification.md, every line a command with its output.

    .venv-hf/bin/python scripts/verification_card.py [--work DIR]

runs the checks below in order (a few minutes on 2 CPU cores), as the card's commands, and writes the
card. .venv-hf is a virtualenv from requirements-hf.txt (transformers and a CPU torch); main.py and
convert.py run in .venv (requirements.txt: no torch). Each check is a command of its own:

    tokenizer HF_DIR          AutoTokenizer.from_pretrained(HF_DIR) against tiktoken on the bundled corpus,
                              and each special token's id in tokenizers and AutoTokenizer (no torch needed)
    random-hf HF_DIR          a transformers-made random tiny DeepseekV3ForCausalLM, save_pretrained
    same RUN_A RUN_B [--all]  every array of two runs' newest checkpoints, bitwise (params and routing bias;
                              --all: the whole state)
    logits HF_DIR RUN_DIR     fp32 logits of transformers' model and ours on 4 sequences of the bundled corpus
    generate HF_DIR RUN_DIR   32 greedy tokens from each
    example HF_DIR            the card's "Loading an export with transformers" lines, run on HF_DIR
    kill-resume RUN_DIR -- ARGS  main.py ARGS, killed with SIGKILL once a checkpoint is written, run again
"""
import argparse
import dataclasses
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

import convert  # noqa: E402
import hf_files  # noqa: E402
from data import hf_tokenizer  # noqa: E402

TOLERANCE = 1e-4        # max |logit difference| allowed in fp32
N_SEQUENCES, N_GREEDY = 4, 32
PROMPT = "And God said,"
# The random transformers-made model: every width distinct, two dense layers then three MoE layers.
RANDOM = dict(vocab_size=100_277, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=5,
              first_k_dense_replace=2, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
              v_head_dim=12, intermediate_size=96, moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=2,
              n_shared_experts=2, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
              max_position_embeddings=64, rope_interleave=True, tie_word_embeddings=False, initializer_range=0.1,
              bos_token_id=100_257, eos_token_id=100_257,
              rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})


def corpus_texts(n):
    """The first n chapters of the bundled corpus' held-out books (data/corpus.py)."""
    from data import corpus
    texts = []
    with gzip.open(corpus.PATH, "rt") as f:
        for line in f:
            doc = json.loads(line)
            if doc["book"] in corpus.VAL_BOOKS:
                texts.append(doc["text"])
            if len(texts) == n:
                return texts
    return texts


def tokenizer_check(hf_dir):
    """Every chapter of the bundled corpus and a set of hard strings: AutoTokenizer's ids against
    encode_ordinary (add_special_tokens=False) and against <|endoftext|> + encode_ordinary (the default, as
    every document here starts). Then the special tokens."""
    from transformers import AutoTokenizer

    from data import corpus
    from data.tokenizer import EOT_ID, get_tokenizer
    enc, hf = get_tokenizer(), AutoTokenizer.from_pretrained(hf_dir)
    with gzip.open(corpus.PATH, "rt") as f:
        texts = [json.loads(line)["text"] for line in f]
    texts += ["12345 1234567 0.000001", "a<|endoftext|>b<|fim_prefix|>", "I'M DON'T you'll", "x  \n \n\n  y   ",
              "日本語 👍🏽 👨‍👩‍👧 𝔘𝔫𝔦", "\r\n\t\u00a0\u2028", ""]
    differ = tokens = 0
    for text in texts:
        ours = enc.encode_ordinary(text)
        tokens += len(ours)
        differ += (hf.encode(text, add_special_tokens=False) != ours or hf(text)["input_ids"] != [EOT_ID] + ours
                   or hf.decode(ours) != text)
    print(f"{type(hf).__name__} from {hf_dir}: {len(texts)} texts ({tokens:,} tokens): {differ} differ from "
          f"tiktoken's encode_ordinary (and decode)")
    return special_tokens_check(hf_dir, hf, enc) and differ == 0


def special_tokens_check(hf_dir, hf, enc):
    """Each of tiktoken's special tokens at its id both ways and decoded to itself, in tokenizers'
    Tokenizer.from_file and in AutoTokenizer `hf`; AutoTokenizer's bos and eos ids config.json's."""
    from tokenizers import Tokenizer
    fast = Tokenizer.from_file(os.path.join(hf_dir, "tokenizer.json"))
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    specials = sorted((enc.encode_single_token(s), s) for s in enc.special_tokens_set)
    wrong = [f"{s} {i}" for i, s in specials
             if (fast.token_to_id(s), fast.id_to_token(i), fast.decode([i], skip_special_tokens=False),
                 hf.convert_tokens_to_ids(s), hf.convert_ids_to_tokens(i), hf.decode([i])) != (i, s, s, i, s, s)]
    wrong += [f"{name} {getattr(hf, name)} (config.json: {config.get(name)})"
              for name in ("bos_token_id", "eos_token_id") if getattr(hf, name) != config.get(name)]
    print(f"special tokens {', '.join(f'{s} {i}' for i, s in specials)}: "
          + (f"{len(wrong)} differ: {'; '.join(wrong)}" if wrong else
             f"each at tiktoken's id in tokenizers and AutoTokenizer and decoded to itself; AutoTokenizer's bos "
             f"and eos ids {hf.bos_token_id} and {hf.eos_token_id}, as config.json's"))
    return not wrong


def random_hf(hf_dir, seed=0):
    """A random tiny DeepseekV3ForCausalLM made by transformers, every norm and routing bias moved off its
    init (ones, zeros) so that a swapped one shows, saved with save_pretrained plus our tokenizer files."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**RANDOM))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn_like(p))
        for layer in model.model.layers[RANDOM["first_k_dense_replace"]:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.05 * torch.randn(RANDOM["n_routed_experts"]))
    model.save_pretrained(hf_dir)
    for name, value in hf_tokenizer.tokenizer_files(RANDOM["max_position_embeddings"]).items():
        with open(os.path.join(hf_dir, name), "w") as f:
            json.dump(value, f)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {hf_dir}: DeepseekV3ForCausalLM {json.dumps({k: v for k, v in RANDOM.items() if 'token' not in k})}, "
          f"{n:,} parameters, files {', '.join(sorted(os.listdir(hf_dir)))}")


def our_model(run_dir):
    """(ModelConfig in fp32 and dropless, params in model order with the routing bias beside the routers)
    of run_dir's newest checkpoint."""
    import sharding
    mc, params, bias, _ = convert.read_checkpoint(run_dir)
    return dataclasses.replace(mc, model_dtype="float32", capacity_factor=0.0), sharding.with_router_bias(params, bias)


def our_logits(mc, params, ids_BT):
    """Our fp32 logits [B, T, vocab] on one device."""
    import jax
    import jax.numpy as jnp

    from collectives import Axes
    from engine import engine_for
    from model import output_logits
    from sharding import build

    @jax.jit
    def logits(params, ids_BT):
        transformer, axes = build(params, mc), Axes(engine=engine_for(mc))
        h_BTD, _, _ = transformer(ids_BT, axes)
        table_vD = transformer.output_table(axes, transformer.embed.gathered(axes))
        return output_logits(h_BTD, table_vD, mc, axes)[..., :mc.vocab_size]
    return np.asarray(logits(params, jnp.asarray(ids_BT)))


def hf_model(hf_dir):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None           # 32 tokens whatever they are
    return model.eval()


def logits_check(hf_dir, run_dir):
    """max |logit difference| between transformers' model from hf_dir and ours from run_dir, fp32, on the
    first N_SEQUENCES held-out chapters of the bundled corpus as documents start here (<|endoftext|>
    first), cut to the model's context T."""
    import torch

    from data.tokenizer import EOT_ID, get_tokenizer
    mc, params = our_model(run_dir)
    enc = get_tokenizer()
    ids = np.array([[EOT_ID] + enc.encode_ordinary(text)[:mc.T - 1] for text in corpus_texts(N_SEQUENCES)])
    ours = our_logits(mc, params, ids)
    with torch.no_grad():
        theirs = hf_model(hf_dir)(torch.tensor(ids)).logits.numpy()
    diff = np.abs(theirs - ours).max()
    agree = (theirs.argmax(-1) == ours.argmax(-1)).mean()
    print(f"{ids.shape[0]} sequences x {ids.shape[1]} tokens of the bundled corpus, fp32: max |logit difference| "
          f"{diff:.3g} (logits up to {np.abs(ours).max():.3g} in size; the same argmax at {agree:.0%} of positions); "
          + ("within" if diff <= TOLERANCE else "OVER") + f" {TOLERANCE:g}")
    return diff <= TOLERANCE


def generate_check(hf_dir, run_dir):
    """N_GREEDY greedy tokens after <|endoftext|> + PROMPT: transformers' generate (its KV cache) against
    ours (generate.generate, the latent KV cache, top-k 1)."""
    import jax
    import torch
    from transformers import AutoTokenizer

    import generate
    from data.tokenizer import EOT_ID, get_tokenizer
    mc, params = our_model(run_dir)
    enc = get_tokenizer()
    prompt = [EOT_ID] + enc.encode_ordinary(PROMPT)
    assert AutoTokenizer.from_pretrained(hf_dir)(PROMPT)["input_ids"] == prompt
    ours = generate.generate(params, mc, prompt, jax.random.key(0), N_GREEDY, top_k=1, temperature=1.0)
    with torch.no_grad():
        out = hf_model(hf_dir).generate(torch.tensor([prompt]), max_new_tokens=N_GREEDY, do_sample=False)
    theirs = out[0, len(prompt):].tolist()
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    print(f"greedy after {PROMPT!r}: ours {ours}\n  transformers' {theirs}\n  "
          + ("identical" if first is None else f"DIFFERENT from token {first}") + f": {enc.decode(ours)!r}")
    return ours == theirs


# What a user types to load an export and generate with it: shown at the card's top, run by `example`.
EXAMPLE = """\
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("hf/dsv3-tiny")
model = AutoModelForCausalLM.from_pretrained("hf/dsv3-tiny", dtype=torch.float32)
inputs = tokenizer("And God said,", return_tensors="pt")        # <|endoftext|> first, as in training
out = model.generate(**inputs, max_new_tokens=32, do_sample=False)
print(tokenizer.decode(out[0], skip_special_tokens=True))
"""


def example_lines():
    """The card's section on loading an export with transformers."""
    return [
        "## Loading an export with transformers", "",
        "Train (or take any run of a model with a DeepSeek-V3 equivalent), export it, and install transformers",
        "with the CPU build of torch in a virtualenv of its own. From PyPI, `pip install torch` on Linux is the",
        "multi-GB CUDA build; PyTorch's CPU index has the CPU build (about 200 MB), which satisfies",
        "requirements-hf.txt's `torch==2.13.0`. `hf/` (like `runs/`) is ignored by git.", "",
        "```bash",
        "python main.py --preset dsv3-tiny --output_dir runs --name dsv3-tiny",
        "python convert.py to-hf runs/dsv3-tiny hf/dsv3-tiny",
        "python3.11 -m venv .venv-hf",
        ".venv-hf/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu",
        ".venv-hf/bin/pip install -r requirements-hf.txt",
        "```", "",
        "Then, in `.venv-hf/bin/python` (`scripts/verification_card.py example HF_DIR` runs these lines):", "",
        "```python", *EXAMPLE.splitlines(), "```", ""]


def example_check(hf_dir):
    """EXAMPLE, its directory hf_dir."""
    exec(EXAMPLE.replace('"hf/dsv3-tiny"', repr(hf_dir)), {})
    return True


def arrays(path, whole_state):
    """{name: numpy array}: an HF directory's tensors; a run's newest checkpoint's params and routing bias
    in model order, or (whole_state) every array of its state as saved."""
    import jax
    if os.path.exists(os.path.join(path, "config.json")):
        return hf_files.read_safetensors(path)
    if whole_state:
        import logging

        import orbax.checkpoint as ocp
        steps = [int(d) for d in os.listdir(os.path.join(path, "checkpoints")) if d.isdigit()]
        # Orbax takes absolute paths only; read onto this one device whatever mesh saved the state (its
        # metadata's shapes and dtypes as the target). Orbax warns of a file its checkpoint manager does not write.
        where = os.path.abspath(os.path.join(path, "checkpoints", str(max(steps)), "state"))
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        logging.getLogger("absl").setLevel(logging.ERROR)
        with ocp.StandardCheckpointer() as checkpointer:
            target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one),
                                  checkpointer.metadata(where).item_metadata)
            state = checkpointer.restore(where, target)
    else:
        _, params, bias, _ = convert.read_checkpoint(path)
        state = {"params": params, "router_bias": bias}
    return {jax.tree_util.keystr(p): np.asarray(a) for p, a in jax.tree_util.tree_leaves_with_path(state)}


def same(a, b, whole_state=False):
    """Whether two HF directories, or two runs' newest checkpoints, hold bitwise-equal arrays. Prints the count."""
    x, y = arrays(a, whole_state), arrays(b, whole_state)
    if sorted(x) != sorted(y):
        print(f"{a} and {b} hold different arrays: {sorted(set(x) ^ set(y))[:5]}")
        return False
    differ = [n for n in x if x[n].dtype != y[n].dtype or x[n].shape != y[n].shape or x[n].tobytes() != y[n].tobytes()]
    print(f"{len(x)} arrays ({sum(v.size for v in x.values()):,} values) of {a} and {b}: "
          + (f"{len(differ)} differ: {', '.join(differ[:5])}" if differ else "all bitwise equal"))
    return not differ


def kill_resume(run_dir, step, command):
    """command (a main.py run of run_dir) killed with SIGKILL as soon as its checkpoint of `step` is
    complete, then run again to its end."""
    done = os.path.join(run_dir, "checkpoints", str(step))
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 1200
    while not os.path.isdir(done):
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            print(f"main.py ended (exit {proc.returncode}) before writing {done}:\n{proc.stderr.read()[-2000:]}")
            return False
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    print(f"killed main.py with SIGKILL (exit {proc.returncode}) once {done} was complete; again:")
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    lines = (again.stdout + again.stderr).splitlines()
    print("\n".join(line for line in lines if line.startswith(("resumed from", "final:", "WARNING: taking over"))))
    return again.returncode == 0


# ----------------------------------------------------------------------------------------------------------
# The card


PY, HF_PY = ".venv/bin/python", ".venv-hf/bin/python"
CARD = f"{HF_PY} scripts/verification_card.py"


def card_steps(work):
    """[(heading, [(command, lines of its output to show (0: all), its expected exit status)])]."""
    runs, hf = f"{work}/runs", f"{work}/hf"
    # the flags from-hf prints for the random model, and a short fine-tune on a mesh of 2 simulated devices
    ft = " ".join(convert.main_flags(convert.model_config(convert.HF_DEFAULTS | RANDOM))
                  + "--training_steps 20 --checkpoint_steps 1 --eval_steps 1 --max_tokens 0 --n_device_axis 2 1 1 "
                    "--cpu_devices 2".split())
    return [
        ("dsv3-tiny: trained here, exported, loaded by transformers", [
            (f"{PY} main.py --preset dsv3-tiny --output_dir {runs} --name dsv3-tiny", 3, 0),
            (f"{PY} convert.py to-hf {runs}/dsv3-tiny {hf}/dsv3-tiny", 0, 0),
            (f"{CARD} tokenizer {hf}/dsv3-tiny", 0, 0),
            (f"{CARD} logits {hf}/dsv3-tiny {runs}/dsv3-tiny", 0, 0),
            (f"{CARD} generate {hf}/dsv3-tiny {runs}/dsv3-tiny", 0, 0),
            (f"{CARD} example {hf}/dsv3-tiny", 0, 0)]),
        ("Round trip: to-hf, then from-hf (and to-hf again)", [
            (f"{PY} convert.py from-hf {hf}/dsv3-tiny {runs}/dsv3-tiny-back", 0, 0),
            (f"{CARD} same {runs}/dsv3-tiny {runs}/dsv3-tiny-back", 0, 0),
            (f"{PY} convert.py to-hf {runs}/dsv3-tiny-back {hf}/dsv3-tiny-again", 0, 0),
            (f"{CARD} same {hf}/dsv3-tiny {hf}/dsv3-tiny-again", 0, 0)]),
        ("A random DeepSeek-V3 made by transformers, imported", [
            (f"{CARD} random-hf {hf}/random", 0, 0),
            (f"{PY} convert.py from-hf {hf}/random {runs}/random", 0, 0),
            (f"{CARD} logits {hf}/random {runs}/random", 0, 0),
            (f"{CARD} generate {hf}/random {runs}/random", 0, 0)]),
        ("Fine-tuning the imported model, killed with SIGKILL and resumed", [
            (f"{PY} convert.py from-hf {hf}/random {runs}/ft-straight", 0, 0),
            (f"{PY} convert.py from-hf {hf}/random {runs}/ft-killed", 0, 0),
            (f"{PY} main.py --output_dir {runs} --name ft-straight {ft}", 2, 0),
            (f"{CARD} kill-resume {runs}/ft-killed 10 -- {PY} main.py --output_dir {runs} --name ft-killed {ft}", 0, 0),
            (f"{CARD} same --all {runs}/ft-straight {runs}/ft-killed", 0, 0)]),
        ("The guide's own preset is refused", [
            (f"{PY} main.py --preset tiny --training_steps 1 --max_tokens 0 --output_dir {runs} --name tiny", 1, 0),
            (f"{PY} convert.py to-hf {runs}/tiny {hf}/tiny", 0, 2)]),
    ]


# The lines of the checks' outputs that the card's summary repeats at its top.
VERDICTS = ("max |logit difference|", "bitwise equal", "differ:", "identical", "DIFFERENT", "from tiktoken",
            "special tokens", "no DeepSeek-V3 equivalent", "killed main.py")


def run_card(work, say=print):
    """Every step's command, in order, into docs/verification.md; False as soon as one fails (the card
    is then not written)."""
    import shlex
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    body, summary = [], []
    for heading, commands in card_steps(work):
        body += [f"## {heading}", ""]
        for command, tail, expected in commands:
            say(f"$ {command}")
            t0 = time.time()
            proc = subprocess.run(shlex.split(command), cwd=ROOT, capture_output=True, text=True)
            out = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()
                   and not line.startswith(("Loading weights", "Writing model shards"))]   # progress bars
            shown = out[-tail:] if tail else out
            cut = [f"... ({len(out) - len(shown)} lines)"] if len(shown) < len(out) else []
            body += ["```", f"$ {command}"] + cut
            body += shown + ([f"(exit {proc.returncode})"] if proc.returncode else []) + [
                f"({time.time() - t0:.0f} s)", "```", ""]
            summary += [f"- {heading}: {line.strip()}" for line in out if any(v in line for v in VERDICTS)]
            if proc.returncode != expected:
                say("\n".join(out[-40:]))
                say(f"exit {proc.returncode}, expected {expected}: the card is not written")
                return False
    head = ["# Verification: the Hugging Face DeepSeek-V3 export and import", "",
            f"Written by `{HF_PY} scripts/verification_card.py` at commit {commit} on "
            f"{time.strftime('%Y-%m-%d', time.gmtime())} ({os.cpu_count()} CPU cores). Each block below is a command",
            "run from the repository root and what it printed (long outputs: their last lines). `.venv` is",
            "requirements.txt: main.py and convert.py, no torch. `.venv-hf` is requirements-hf.txt: transformers "
            f"{_version('transformers')}, torch {_version('torch')} (CPU).",
            "The checks are scripts/verification_card.py's subcommands; the layouts they check are described in",
            "convert.py's docstring.",
            ""] + example_lines() + ["## Summary", ""] + summary + [""]
    path = os.path.join(ROOT, "docs", "verification.md")
    with open(f"{path}.tmp", "w") as f:
        f.write("\n".join(head + body))
    os.replace(f"{path}.tmp", path)
    say(f"wrote {path}")
    return True


def _version(package):
    from importlib.metadata import version
    return version(package)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default=os.path.join("runs", "verification"),
                        help="directory for the card's runs and exports, emptied first (default runs/verification)")
    commands = parser.add_subparsers(dest="command")
    for name in ("tokenizer", "random-hf", "example"):
        commands.add_parser(name).add_argument("hf_dir")
    for name in ("logits", "generate"):
        sub = commands.add_parser(name)
        sub.add_argument("hf_dir")
        sub.add_argument("run_dir")
    sub = commands.add_parser("same")
    sub.add_argument("--all", action="store_true", help="the whole state of each run's newest checkpoint")
    sub.add_argument("a")
    sub.add_argument("b")
    sub = commands.add_parser("kill-resume")
    sub.add_argument("run_dir")
    sub.add_argument("step", type=int)
    sub.add_argument("main_command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    import utils
    from multihost import set_up_devices
    set_up_devices(utils.Config())          # as main.py does first: the CPU, quietly, off a TPU VM with libtpu
    checks = {"tokenizer": lambda: tokenizer_check(args.hf_dir),
              "random-hf": lambda: random_hf(args.hf_dir) or True,
              "logits": lambda: logits_check(args.hf_dir, args.run_dir),
              "generate": lambda: generate_check(args.hf_dir, args.run_dir),
              "example": lambda: example_check(args.hf_dir),
              "same": lambda: same(args.a, args.b, args.all),
              "kill-resume": lambda: kill_resume(args.run_dir, args.step, [a for a in args.main_command if a != "--"]),
              None: lambda: run_card(args.work)}
    return 0 if checks[args.command]() else 1


if __name__ == "__main__":
    sys.exit(main())
