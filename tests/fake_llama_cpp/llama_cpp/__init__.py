"""A stand-in for llama-cpp-python with the few calls llama_driver.py makes, for tests without llama.cpp.

A "model file" is JSON {"vocab": V, "noise": a, "seed": s}: the logits after token t are row t of a fixed
random (V, V) matrix (seed 0) plus `noise` times row t of another one (seed s), so a model with noise 0 is the
baseline and the figures of any other are computable in the test (`fake_logits`)."""

import ctypes
import json

import numpy as np

__version__ = "0.0-fake"


def fake_logits(spec: dict) -> np.ndarray:
    v = spec["vocab"]
    base = np.random.default_rng(0).standard_normal((v, v)) * 2
    return (base + spec.get("noise", 0.0) * np.random.default_rng(spec.get("seed", 1)).standard_normal((v, v))
            ).astype(np.float32)


class _Context:
    """The context's logits of the last batch's last token, as llama_get_logits gives them (a float pointer)."""

    def __init__(self, vocab):
        self.last = np.zeros(vocab, dtype=np.float32)

    def get_logits(self):
        return self.last.ctypes.data_as(ctypes.POINTER(ctypes.c_float))


class Llama:
    """As llama-cpp-python 0.3.x: `scores` is filled only with logits_all (else only the context has the logits)."""

    def __init__(self, model_path, n_ctx=512, logits_all=False, **kwargs):
        with open(model_path) as f:
            self.spec = json.load(f)
        self.table = fake_logits(self.spec)
        self._logits_all = logits_all
        self._n_vocab = self.spec["vocab"]
        self._ctx = _Context(self._n_vocab)
        self.scores = np.zeros((n_ctx, self.spec["vocab"]), dtype=np.float32)
        self.n_tokens = 0

    def n_vocab(self):
        return self._n_vocab

    def reset(self):
        self.n_tokens = 0

    def eval(self, tokens):
        rows = self.table[np.asarray(tokens)]
        if self._logits_all:
            self.scores[self.n_tokens:self.n_tokens + len(tokens)] = rows
        self._ctx.last[:] = rows[-1]
        self.n_tokens += len(tokens)


def llama_print_system_info():
    return b"FAKE = 1"


class llama_model_imatrix_data(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("data", ctypes.POINTER(ctypes.c_float)), ("size", ctypes.c_size_t)]


class llama_model_quantize_params(ctypes.Structure):
    _fields_ = [("nthread", ctypes.c_int32), ("ftype", ctypes.c_int), ("allow_requantize", ctypes.c_bool),
                ("imatrix", ctypes.POINTER(llama_model_imatrix_data))]


def llama_model_quantize_default_params():
    return llama_model_quantize_params()


def llama_model_quantize(src, dst, params):
    p = ctypes.cast(params, ctypes.POINTER(llama_model_quantize_params)).contents
    names = []
    if p.imatrix:
        arr = p.imatrix
        i = 0
        while arr[i].name is not None:
            names.append((arr[i].name.decode(), [arr[i].data[j] for j in range(arr[i].size)]))
            i += 1
    with open(src) as f:
        spec = json.load(f)
    spec.update(ftype=p.ftype, imatrix=names)
    with open(dst, "w") as f:
        json.dump(spec, f)
    return 0
