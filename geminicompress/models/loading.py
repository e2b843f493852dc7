"""Resolve what the user typed as MODEL and load it, safely by default.

MODEL may be:
- the demo alias `smollm2-demo` (see `demo.py`);
- a `.gguf` file, loaded through transformers' GGUF support and dequantized to float;
- a local directory in transformers layout, dense or in a format this project writes (`formats.py`);
- a hub id such as `HuggingFaceTB/SmolLM2-135M`.

Safety: remote code runs only with `trust_remote_code=True`; pickled weights (`*.bin`, `*.pt`) are
refused unless `allow_pickle=True` (they can execute code when unpickled).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from geminicompress import formats
from geminicompress.core.errors import GeminiError, InputError
from geminicompress.models import demo
from geminicompress.models.finite import check_named, check_stored
from geminicompress.models.headers import read_headers, safetensors_config

log = logging.getLogger(__name__)

SourceKind = Literal["demo", "gguf", "dir", "hub"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$|^[A-Za-z0-9][\w.\-]*$")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl")


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: `spec` as typed, `kind`, and the local path when there is one."""

    spec: str
    kind: SourceKind
    path: Path | None = None
    gguf_file: str | None = None


@dataclass
class LoadedModel:
    model: Any  # transformers PreTrainedModel
    tokenizer: Any  # transformers PreTrainedTokenizerBase
    source: ModelSource
    format: str | None = None  # None for dense checkpoints
    nonfinite: list[dict] | None = None  # NaN/Inf tensors `allow_nonfinite` let through (models/finite.py)
    unused: list[str] | None = None  # checkpoint tensors the model does not use (transformers ignored them)


def resolve_model(spec: str) -> ModelSource:
    """Classify MODEL without loading anything (used by `validate` too)."""
    if spec == demo.DEMO_ALIAS:
        return ModelSource(spec, "demo", demo.demo_gguf_path())
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise InputError(f"model file {spec} does not exist")
        target = path.resolve()  # a link's target: its folder and its own name (they may differ from the link's)
        return ModelSource(spec, "gguf", target.parent, target.name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise InputError(f"{spec} is a directory but has no config.json: not a transformers model directory")
        return ModelSource(spec, "dir", path.resolve())
    if path.exists():
        raise InputError(f"{spec} is a file; MODEL must be a model directory, a .gguf file or a hub id")
    looks_local = spec.startswith((".", "/", "~")) or os.sep in spec.strip("/").replace("/", "", 1)
    if looks_local or not _HUB_ID.match(spec):
        raise InputError(f"model directory {spec} does not exist")
    return ModelSource(spec, "hub")


def load_model(
    spec: str,
    *,
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    allow_nonfinite: bool = False,
    tokenizer: bool = True,
) -> LoadedModel:
    """Load model and tokenizer from MODEL; raise a `GeminiError` with one clear line on failure, a
    `NonFiniteError` (an input error) when a float tensor holds NaN/Inf unless `allow_nonfinite`.
    `tokenizer=False`: a local directory's weights alone (LoadedModel.tokenizer None; the check of OUT)."""
    source = resolve_model(spec)
    fmt, unused, path = None, None, None
    if source.kind == "gguf":
        model, tok = _load_gguf(source.path, source.gguf_file, dtype)
    elif source.kind == "hub":
        model, tok, unused = _load_hub(spec, dtype, trust_remote_code, allow_pickle)
    else:
        path = demo_dir() if source.kind == "demo" else source.path
        model, tok, fmt, unused = _load_dir(path, dtype, trust_remote_code, allow_pickle, tokenizer)
    model.eval()
    stored = path if fmt is None else None  # a local dense directory's weights
    return LoadedModel(model, tok, source, fmt, nonfinite=_check_finite(model, stored, dtype, unused, allow_nonfinite),
                       unused=unused)


def _check_finite(model: torch.nn.Module, stored: Path | None, dtype: torch.dtype, unused: list[str] | None,
                  allow: bool) -> list[dict]:
    """models/finite.py's check of every float weight: from the files when the model holds them as stored
    (a dense directory loaded in its own dtype, whose tensors are views of the mapped files: reading them would
    bring the whole file into this process), else from the model's state dict."""
    if stored is not None and safetensors_config(stored) is not None:  # pickled weights: the state dict
        tensors = {k: v for k, v in read_headers(stored).items() if k not in set(unused or ())}
        if all(i.dtype == dtype for i in tensors.values() if i.dtype.is_floating_point):
            return check_stored(tensors, allow)
    return check_named(model.state_dict().items(), allow)


def check_loading_info(where: str, info: dict[str, Any]) -> list[str]:
    """transformers' loading info of `from_pretrained(..., output_loading_info=True)`: an InputError when the
    checkpoint lacks a tensor the config needs (transformers would initialise it at random) or holds one with
    another shape; returns the checkpoint's tensors the model does not use (for a warning)."""
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise InputError(f"{where}: tensor {missing[0]}{more} is missing from the checkpoint (config.json needs it: "
                         "does config.json describe these weights?); nothing was written")
    mismatched = list(info.get("mismatched_keys") or [])
    if mismatched:
        name, got, want = (list(mismatched[0]) + [None, None])[:3]
        raise InputError(f"{where}: tensor {name} has shape {list(got) if got else '?'} but config.json implies "
                         f"{list(want) if want else 'another'}")
    return sorted(info.get("unexpected_keys") or [])


def unused_warning(where: str, unused: list[str]) -> str:
    """The one warning line for checkpoint tensors the model does not use."""
    more = f" and {len(unused) - 1} more" if len(unused) > 1 else ""
    return (f"{where} holds {len(unused)} tensor(s) the model's config does not use ({unused[0]}{more}); they are "
            "ignored and not written")


def _check_weights(path: Path, allow_pickle: bool) -> None:
    names = [p.name for p in path.iterdir()]
    has_safe = any(n.endswith(".safetensors") for n in names)
    pickled = [n for n in names if n.endswith(_PICKLE_SUFFIXES) and n != "training_args.bin"]
    if not has_safe and pickled and not allow_pickle:
        raise InputError(
            f"{path} holds only pickled weights ({pickled[0]}), which can run code when loaded; "
            "pass --allow-pickle if you trust it"
        )
    if not has_safe and not pickled:
        raise GeminiError(f"{path} has a config.json but no weights (*.safetensors)")


def _load_dir(path: Path, dtype: torch.dtype, trust_remote_code: bool, allow_pickle: bool, tokenizer: bool = True):
    from transformers import AutoModelForCausalLM

    _check_weights(path, allow_pickle)
    if tokenizer:
        check_tokenizer_files(path)  # before the weights load: said in a second, not after the model is read
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise GeminiError(f"{path}/config.json cannot be read: {exc}") from exc
    key = formats.detect(config)
    try:
        unused: list[str] = []
        if key is None:
            model, info = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, trust_remote_code=trust_remote_code, use_safetensors=not allow_pickle or None,
                output_loading_info=True,
            )
            unused = check_loading_info(str(path), info)
        else:
            model = formats.load(path, config, dtype)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise GeminiError(f"{path} does not load as a causal language model: {_first_line(exc)}") from exc
    return model, load_tokenizer(str(path), trust_remote_code) if tokenizer else None, key, unused


def load_tokenizer(where: str, trust_remote_code: bool, **kwargs: Any):
    from transformers import AutoTokenizer

    if Path(where).is_dir() and "gguf_file" not in kwargs:
        check_tokenizer_files(Path(where))
    try:
        return AutoTokenizer.from_pretrained(where, trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        text = " ".join(str(exc).split())[:400] or type(exc).__name__  # the whole message on one line, not its first
        raise GeminiError(f"{where}: the tokenizer does not load: {text}") from exc


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def check_tokenizer_files(path: Path) -> None:
    """An InputError (exit 2, before any work) naming what is missing when the model directory `path` has no
    tokenizer: neither tokenizer.json nor tokenizer.model (nor a vocab.json with merges.txt)."""
    names = {p.name for p in path.iterdir()}
    if {"tokenizer.json", "tokenizer.model"} & names or {"vocab.json", "merges.txt"} <= names:
        return
    missing = [n for n in TOKENIZER_FILES if n not in names]
    said = f"{', '.join(missing[:-1])} and {missing[-1]} are" if len(missing) > 1 else f"{missing[0]} is"
    raise InputError(f"{path} has no tokenizer: {said} missing; copy the tokenizer files of the model these "
                     "weights come from into it.")


def _load_gguf(folder: Path, gguf_file: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    try:
        import gguf  # noqa: F401  (transformers needs it; fail with our message, not theirs)
    except ImportError as exc:
        raise InputError("loading .gguf files needs the `gguf` package: pip install gguf") from exc
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=dtype)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise GeminiError(f"{folder / gguf_file} does not load: {_first_line(exc)}") from exc
    tok = load_tokenizer(str(folder), False, gguf_file=gguf_file)
    # Dequantized to float: drop the GGUF quantizer so the model saves as an ordinary dense checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tok


def _load_hub(spec: str, dtype: torch.dtype, trust_remote_code: bool, allow_pickle: bool):
    from transformers import AutoModelForCausalLM

    offline = _hub_offline(spec)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            spec, dtype=dtype, trust_remote_code=trust_remote_code,
            use_safetensors=None if allow_pickle else True, local_files_only=offline, output_loading_info=True,
        )
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise GeminiError(
            f"could not load '{spec}' from the hub: {_first_line(exc)} "
            "(offline? download it once or pass a local directory)"
        ) from exc
    unused = check_loading_info(spec, info)
    return model, load_tokenizer(spec, trust_remote_code, local_files_only=offline), unused


def _hub_offline(spec: str) -> bool:
    """True when the hub cannot be used and `spec` is in the local cache: load it from there.

    Without this check an unreachable hub costs ~26 s of retries (huggingface_hub backs off 1, 2, 4,
    8, 8 s on each file it does not have) before the error. One probe, with no retries, decides instead:
    reachable -> load normally; unreachable and cached -> cache only; unreachable and not cached -> one
    clear line now.
    """
    from huggingface_hub import constants, try_to_load_from_cache

    cached = isinstance(try_to_load_from_cache(spec, "config.json"), str)
    offline_mode = getattr(constants, "is_offline_mode", lambda: constants.HF_HUB_OFFLINE)
    if offline_mode():
        if not cached:
            raise GeminiError(
                f"could not load '{spec}' from the hub: HF_HUB_OFFLINE is set and it is not in the local "
                "cache (download it once or pass a local directory)"
            )
        return True
    problem = _probe_hub(constants.ENDPOINT)
    if problem is None:
        return False
    if cached:
        log.info("%s is unreachable (%s); loading '%s' from the local cache", constants.ENDPOINT, problem, spec)
        return True
    raise GeminiError(
        f"could not load '{spec}' from the hub: {constants.ENDPOINT} is unreachable ({problem}) and "
        "it is not in the local cache (offline? download it once or pass a local directory)"
    )


def _probe_hub(endpoint: str, timeout_s: float = 5.0) -> str | None:
    """One HEAD request to the hub endpoint, no retries: None if it answers at all, else why not."""
    from huggingface_hub import get_session

    try:
        get_session().head(endpoint, timeout=timeout_s)  # neither client follows redirects on HEAD
    except _transport_errors() as exc:
        return _first_line(exc)
    return None


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Network failures of the HTTP client huggingface_hub uses (requests' are OSErrors; httpx's are not)."""
    import importlib

    errors: list[type[BaseException]] = [OSError]
    for name in ("httpx2", "httpx"):
        try:
            errors.append(importlib.import_module(name).HTTPError)
        except ImportError:
            continue
    return tuple(errors)


def local_dir(spec: str) -> Path | None:
    """The local transformers directory MODEL names (the demo's converted copy included), else None (a .gguf
    file, a hub id). Raises the resolver's own one-line error for a MODEL that does not exist."""
    source = resolve_model(spec)
    if source.kind == "demo":
        return demo_dir()
    return source.path if source.kind == "dir" else None


def demo_dir() -> Path:
    """The demo model converted once into a transformers directory in the cache."""
    target = demo.demo_cache_dir()
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    gguf = demo.demo_gguf_path()
    log.info("converting the demo model %s once into %s", gguf.name, target)
    model, tok = _load_gguf(gguf.parent, gguf.name, torch.float32)
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]


def pad_token_id(model: torch.nn.Module) -> int:
    """The id generate() pads finished rows with: the model's pad token, else its (first) EOS token, else 0."""
    config = model.generation_config
    for value in (config.pad_token_id, config.eos_token_id):
        value = value[0] if isinstance(value, (list, tuple)) and value else value
        if isinstance(value, int):
            return value
    return 0
