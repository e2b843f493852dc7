"""`serve-bench`: the serving table. One workload (workload.py), one row per serving optimization (rows.py),
each row added to the best configuration measured above it (stack.py), every row measured in the same run
in two passes (passes.py): a burst for each row's capacity, then one load for all, below the stack's capacity.

Everything a run can refuse (the workload, the load, the given models: a student larger than its teacher, a
draft with another vocabulary, an INT4 folder that is not 4-bit) is refused here before any model loads.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from geminicompress import __version__
from geminicompress.data import pack_windows, prefix_note, read_text, text_prefix, tokenize
from geminicompress.core.errors import InputError
from geminicompress.eval.cost import plan as plan
from geminicompress.eval.engines import llama_eval
from geminicompress.eval.engines.vllm_engine import check_vllm, find_python
from geminicompress.eval.serving.llama_server import LlamaServer, llama_rows
from geminicompress.eval.serving.passes import measure
from geminicompress.eval.serving.rows import hf_rows, vllm_rows
from geminicompress.eval.serving.servers import HFServer, Models, VllmServer
from geminicompress.eval.serving.stack import DEFAULT_LOAD, Load
from geminicompress.eval.serving.workload import WorkloadSpec, build_workload, check_spec
from geminicompress.host.machine import machine, versions
from geminicompress.host.progress import NullProgress, Progress

PPL_SEQ_LEN = 512


@dataclass(frozen=True)
class ServeOptions:
    """How serve-bench serves its workload: the engine (transformers, vllm or llama.cpp), the largest batch of the dynamic
    batching row, the timed rows' load (a share of the stack's capacity), the capacity pass's burst, how many tokens of DATA the perplexity windows take, DATA's text column, the python that
    runs vLLM (and llama.cpp), the dtype the models are loaded in ("auto": as stored), whether loading may run the
    model's own code, and how prompts and windows start (`frame`: data/windows.py)."""

    engine: str = "transformers"
    max_batch: int = 8
    ppl_tokens: int = 4096
    text_column: str = "text"
    vllm_python: str | None = None
    llama_python: str | None = None
    dtype: str = "auto"
    trust_remote_code: bool = False
    frame: str = "tokenizer"  # data/windows.py: "tokenizer" (its BOS first, where it adds one) or "text"
    load: float | None = None  # the timed rows' rate as a share of the stack's capacity (None: DEFAULT_LOAD)
    capacity_requests: int | None = None  # the capacity pass's burst (None: min(requests, 2 x max_batch))
    concurrency: int | None = None  # the timed rows as a closed loop of this many clients, instead of a rate


def check_load(rate: float | None, share: float | None, concurrency: int | None = None) -> Load:
    """How the timed rows are loaded (stack.Load); bad combinations refused in one line."""
    given = [f for f, v in (("--rate", rate), ("--load", share), ("--concurrency", concurrency)) if v is not None]
    if len(given) > 1:
        raise InputError(f"{' and '.join(given)} both set: the timed rows run at one of them")
    if concurrency is not None and concurrency < 1:
        raise InputError(f"--concurrency must be at least 1 client, got {concurrency}")
    if rate is not None or concurrency is not None:
        return Load(None, rate, concurrency)
    share = DEFAULT_LOAD if share is None else share
    if not 0 < share < 1:
        raise InputError(f"--load must be a share of the stack's capacity between 0 and 1 (a load it holds), "
                         f"got {share:g}")
    return Load(share)


def _size(config: dict) -> tuple[int, int, int]:
    return (int(config.get("num_hidden_layers") or 0), int(config.get("hidden_size") or 0),
            int(config.get("intermediate_size") or 0))


def check_models(models: Models, trust_remote_code: bool, engine: str = "transformers") -> None:
    """Refuse, before any model loads, given models that cannot take their rows (one line each; GGUF files,
    for llama.cpp, are checked by llama.cpp)."""
    from geminicompress.eval.engines.torch_kernels import expects_int4
    from geminicompress.models.loading import resolve_model

    for flag, path in (("--int8", models.int8), ("--int4", models.int4), ("--student", models.student),
                       ("--draft", models.draft)):
        if path is not None:
            resolve_model(path)  # a missing folder: one line now, not after the first rows
    teacher = plan.peek_config(models.base) or {}
    if models.int4 is not None and engine != "llama.cpp" and not expects_int4(plan.peek_config(models.int4)):
        raise InputError(f"--int4 {models.int4}: not a 4-bit GPTQ/AWQ/pack-quantized checkpoint (from "
                         "`quantize MODEL -o OUT --method gptq`)")
    if models.student is not None:
        student = plan.peek_config(models.student) or {}
        if teacher and student and any(s > t for s, t in zip(_size(student), _size(teacher))):
            raise InputError(f"--student {models.student} is larger than its teacher {models.base} (layers, hidden, "
                             f"MLP: {_size(student)} against {_size(teacher)}): a student serves in its place smaller")
    if models.draft is not None:
        _check_draft(models, teacher, trust_remote_code)


def _check_draft(models: Models, teacher: dict, trust_remote_code: bool) -> None:
    """The verifier checks the draft's token ids: the two must share one vocabulary."""
    draft = plan.peek_config(models.draft) or {}
    vocab = (teacher.get("vocab_size"), draft.get("vocab_size"))
    if None not in vocab and vocab[0] != vocab[1]:
        raise InputError(f"--draft {models.draft} has a vocabulary of {vocab[1]} tokens, {models.base} of {vocab[0]}: "
                         "speculative decoding needs a draft with the served model's tokenizer")
    ours, theirs = plan.peek_tokenizer(models.base, trust_remote_code), plan.peek_tokenizer(models.draft,
                                                                                           trust_remote_code)
    if ours is not None and theirs is not None and ours.get_vocab() != theirs.get_vocab():
        raise InputError(f"--draft {models.draft} has another tokenizer than {models.base}: speculative decoding "
                         "needs a draft with the served model's tokenizer")


def serve_bench(models: Models, data: str, spec: WorkloadSpec, options: ServeOptions = ServeOptions(),
                progress: Progress | None = None) -> dict:
    """Measure every row on one workload; the report (table.py renders it)."""
    progress = progress or NullProgress()
    config = plan.peek_config(models.base) or {}
    check_spec(spec, plan.config_context(config))  # before any model loads
    load = check_load(spec.rate, options.load, options.concurrency)
    if options.engine == "vllm" and (options.concurrency or 1) > 1:
        raise InputError("--concurrency with --engine vllm: not wired here (give --load or --rate)")
    if options.engine not in ("transformers", "vllm", "llama.cpp"):
        raise InputError(f"--engine must be transformers, vllm or llama.cpp, got '{options.engine}'")
    if options.max_batch < 2:
        raise InputError(f"--max-batch must be at least 2 (the dynamic batching row), got {options.max_batch}")
    check_models(models, options.trust_remote_code, options.engine)
    tok = plan.peek_tokenizer(models.base, options.trust_remote_code)
    if tok is None:
        raise InputError(f"{models.base}: serve-bench needs a local model (directory or smollm2-demo)")
    text = read_text(data, options.text_column)
    ids = tokenize(tok, text, None)
    prefix = text_prefix(tok, options.frame, config.get("vocab_size"))  # prompts and windows start as the tokenizer starts a text
    requests, repeated = build_workload(torch.cat([torch.tensor(prefix, dtype=ids.dtype), ids]), spec)
    windows = (pack_windows(ids[:options.ppl_tokens], PPL_SEQ_LEN, prefix=prefix)
        if options.ppl_tokens >= PPL_SEQ_LEN and ids.numel() >= PPL_SEQ_LEN else None)
    given = {k: getattr(models, k) for k in ("int8", "int4", "student", "draft")}
    if options.engine == "llama.cpp":
        python = llama_eval.find_python(options.llama_python)
        llama_eval.check_llama(python)  # absent: one line, exit 2, before any model loads
        rows = llama_rows(given)
        server = LlamaServer(models, spec, windows, python, torch.get_num_threads())
    elif options.engine == "vllm":
        python = find_python(options.vllm_python)
        check_vllm(python)  # absent / too old: one line, exit 2, before any model loads
        rows = vllm_rows(options.max_batch, given, torch.cuda.is_available())
        server = VllmServer(models, spec, windows, options.dtype, python)
    else:
        rows = hf_rows(options.max_batch, given)
        server = HFServer(models, spec, windows, options.dtype, options.trust_remote_code)
    burst = options.capacity_requests or min(spec.requests, 2 * options.max_batch)
    measured, loaded = measure(rows, requests, burst, load, spec.seed, server, progress)
    notes = [f"the text held {spec.requests - repeated} distinct questions; {repeated} repeat earlier text"] if repeated else []
    return {"geminicompress": __version__, "command": "serve-bench", "engine": options.engine, "model": models.base,
            **given, "data": data, "workload": {**asdict(spec), "truncated_len": spec.truncated_len},
            "max_batch": options.max_batch, "load": loaded, "window_prefix": prefix_note(tok, prefix),
            "rows": measured, "notes": notes, "machine": {**machine(), "torch_threads": torch.get_num_threads()},
            "versions": versions()}
