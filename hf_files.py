"""The files of convert.py's Hugging Face directories: safetensors (one file, or shards with an index),
JSON, and a directory written whole or not at all. A Hugging Face directory may come from anyone: every
file read from it is checked, before it is opened, to be a regular file inside it."""
import atexit
import errno
import json
import os
import re
import shutil
import stat

from safetensors import safe_open
from safetensors.numpy import save_file

from rundir import os_error

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
INSIDE = "HF_DIR's files must be regular files inside it, named relative to it"


class ConvertError(Exception):
    """Bad input: one line naming the flag, file or field and what would be valid; exit 2."""


def parse_size(text):
    """'5GB', '200MB', '10KB' or a number of bytes (decimal units, as transformers' max_shard_size)."""
    units = {"GB": 10**9, "MB": 10**6, "KB": 10**3, "B": 1}
    upper = text.strip().upper()
    unit = next((u for u in units if upper.endswith(u)), "B")
    try:
        size = float(upper[:len(upper) - len(unit)] if upper.endswith(unit) else upper) * units[unit]
    except ValueError:
        size = 0
    if size < 1:
        raise ConvertError(f"--max_shard_size {text!r}: give a size such as 5GB, 200MB or a number of bytes")
    return int(size)


def human(n_bytes):
    """n_bytes in MB below a GB, else GB (decimal, as --max_shard_size)."""
    return f"{n_bytes / 1e6:.1f} MB" if n_bytes < 1e9 else f"{n_bytes / 1e9:.1f} GB"


def write_safetensors(directory, tensors, max_shard_bytes):
    """tensors into model.safetensors, or, past max_shard_bytes, into model-0000i-of-0000n.safetensors
    files of at most that many bytes each (one bigger tensor alone in its file) and the index transformers
    reads: {"metadata": {"total_size"}, "weight_map": {name: file}}. Returns the file names."""
    shards, size = [[]], 0
    for name, w in tensors.items():
        if shards[-1] and size + w.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += w.nbytes
    files = ([SINGLE] if len(shards) == 1
             else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)])
    # safetensors writes through a temporary file of mode 0600 and keeps that mode: the files get the mode
    # any new file gets here (0644 under umask 022), for whoever else reads the model
    mask = os.umask(0)
    os.umask(mask)
    for file, names in zip(files, shards):
        path = os.path.join(directory, file)
        save_file({name: tensors[name] for name in names}, path, metadata={"format": "pt"})
        os.chmod(path, 0o666 & ~mask)
    if len(shards) == 1:
        return files
    index = {"metadata": {"total_size": sum(w.nbytes for w in tensors.values())},
             "weight_map": {name: file for file, names in zip(files, shards) for name in names}}
    write_json(os.path.join(directory, INDEX), index)
    return files + [INDEX]


def read_safetensors(directory):
    """{name: numpy array} of an HF directory's model.safetensors or the files its index names."""
    index_path, single = os.path.join(directory, INDEX), os.path.join(directory, SINGLE)
    if os.path.lexists(index_path):
        index = read_json(inside(directory, INDEX))
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConvertError(f"{index_path} has no weight_map of tensor names to files")
        paths = {file: inside(directory, file, index_path) for file in sorted(set(weight_map.values()))}
    elif os.path.lexists(single):
        weight_map, paths = None, {SINGLE: inside(directory, SINGLE)}
    else:
        raise ConvertError(f"{directory} has neither {SINGLE} nor {INDEX}; save the model with safetensors "
                           f"(transformers' save_pretrained does by default)")
    tensors = {}
    for file, path in paths.items():
        try:
            with safe_open(path, framework="np") as f:
                tensors |= {name: f.get_tensor(name) for name in f.keys()}
        except Exception as e:
            raise ConvertError(f"{os.path.join(directory, file)} cannot be read as safetensors "
                               f"({type(e).__name__}: {e})") from None
    missing = sorted(set(weight_map or {}) - set(tensors))
    if missing:
        raise ConvertError(f"{index_path} lists {missing[0]} in {weight_map[missing[0]]}, which does not hold it"
                           + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return tensors


def inside(directory, name, named_in=None):
    """The real path of file `name` of `directory`, a regular file inside it; ConvertError otherwise, before the
    file is opened (a FIFO would block the import forever, a name such as ../../x or a link out of the
    directory would import a file its author chose from anywhere). named_in: the file that names it. The
    one link out allowed is the Hugging Face cache's, from snapshots/REV/ into the repository's blobs/."""
    named = f"{named_in} names {name!r}"
    if not isinstance(name, str) or not name or "\0" in name:
        raise ConvertError(f"{named}, not a file name: {INSIDE}")
    if os.path.isabs(name):
        raise ConvertError(f"{named}, an absolute path: {INSIDE}")
    if os.path.normpath(name) == os.pardir or os.path.normpath(name).startswith(os.pardir + os.sep):
        raise ConvertError(f"{named}, outside {directory}: {INSIDE}")
    path = os.path.join(directory, name)
    real, top = os.path.realpath(path), os.path.realpath(directory)
    roots = [top]
    if os.path.basename(os.path.dirname(top)) == "snapshots":
        roots.append(os.path.join(os.path.dirname(os.path.dirname(top)), "blobs"))
    if not any(os.path.commonpath([real, root]) == root for root in roots):
        raise ConvertError(f"{path} is a link to {real}, outside {directory}: {INSIDE}")
    try:
        mode = os.stat(real).st_mode
    except FileNotFoundError:
        raise ConvertError(f"{path} is missing" + (f" ({named_in} names it)" if named_in else "")) from None
    except OSError as e:
        raise ConvertError(f"{path} cannot be read ({e})") from None
    if not stat.S_ISREG(mode):
        kinds = {stat.S_ISFIFO: "a FIFO", stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device",
                 stat.S_ISDIR: "a directory", stat.S_ISSOCK: "a socket"}
        kind = next((text for test, text in kinds.items() if test(mode)), "not a file")
        raise ConvertError(f"{path} is {kind}, not a regular file: {INSIDE}")
    return real


def json_text(value):
    return json.dumps(value, indent=2, ensure_ascii=False) + "\n"


def write_text(path, text):
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def write_json(path, value):
    write_text(path, json_text(value))


def read_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ConvertError(f"{path} is missing") from None
    except (OSError, ValueError) as e:
        raise ConvertError(f"{path} cannot be read as JSON ({e})") from None


def fresh_dir(path, what):
    """ConvertError unless `path` is free for a new directory (missing or empty)."""
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise ConvertError(f"{what} {path} exists and is not an empty directory; give a new path")


def check_room(path, what, need):
    """ConvertError naming the flag `what` when the disk that would hold the new directory `path` has less
    than `need` bytes free."""
    parent = os.path.dirname(os.path.abspath(path.rstrip("/")))
    while not os.path.isdir(parent):
        parent = os.path.dirname(parent)
    free = shutil.disk_usage(parent).free
    if free < need:
        raise ConvertError(f"{what} {path} needs about {human(need)}; its disk has {human(free)} free. Free some "
                           f"space or give another {what}")


def write_atomically(path, what, need, fill):
    """fill(tmp) builds the directory `path` (the flag `what`, about `need` bytes) in a temporary sibling,
    renamed to `path` once complete: a failure leaves nothing behind. Too little free space for `need`
    is refused first; a write that fails at the OS (the disk filled up meanwhile) is one line too."""
    check_room(path, what, need)
    tmp = f"{path.rstrip('/')}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        result = fill(tmp)
        os.rename(tmp, path)
    except ConvertError:
        raise
    except Exception as e:
        # writer threads of a failed save (Orbax's) may go on writing into tmp until the interpreter waits
        # for them at exit; atexit runs after that
        atexit.register(shutil.rmtree, tmp, True)
        code = _errno(e)
        if code is None:
            raise
        room = f" (it needs about {human(need)}). Free some space or give another {what}"
        raise ConvertError(f"{what} {path}: [Errno {code}] {os.strerror(code)}"
                           + (room if code in (errno.ENOSPC, errno.EDQUOT) else "")) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def _errno(e):
    """The errno of the OS error behind e, or None: an OSError, one Orbax wraps (rundir.os_error, which
    checkpoints.SaveFailed quotes), safetensors' '... (os error N)'."""
    code = re.search(r"\(os error (\d+)\)|\[Errno (\d+)\]", f"{e} {os_error(e)}")
    return int(code[1] or code[2]) if code else None
