"""The allocator setting that keeps resident memory close to the live tensors."""

import sys

import pytest

from geminicompress.host.memory import return_freed_memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt exists on Linux only")
def test_glibc_accepts_the_fixed_mmap_threshold():
    assert return_freed_memory() is True
    assert return_freed_memory() is True  # idempotent


_PROBE = """
import torch
from geminicompress.host.memory import release_free_heap, return_freed_memory
def anon():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssAnon"))
return_freed_memory()
small, keep = [], []
for _ in range(1000):
    small.append(torch.ones(100_000))  # 400 KB each, below the mmap threshold: the heap
    keep.append(torch.ones(16))  # a live chunk after each: the freed ones cannot merge into the top
del small
before = anon()
trimmed = release_free_heap()
print(trimmed, before - anon())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim exists on Linux only")
def test_free_heap_pages_go_back_to_the_system():
    """Freed heap buffers with live ones between them (so free() cannot shrink the heap) stay resident
    until release_free_heap gives them back. In a fresh interpreter: a test process's heap, shaped by
    the tests before, makes the amount unpredictable."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "True"
    assert int(out[1]) > 300_000  # KiB: most of the ~400 MB freed is handed back


_REUSE_PROBE = """
import resource, torch
from geminicompress.host.memory import heap_reuse, return_freed_memory
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def churn():
    start = faults()
    for _ in range(100):
        x = torch.ones(2_000_000)  # 8 MB, written: every page is touched
        del x
    return faults() - start
return_freed_memory()
outside = churn()
with heap_reuse():
    inside = churn()
print(outside, inside)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt exists on Linux only")
def test_heap_reuse_serves_repeated_big_buffers_without_fresh_pages():
    """With the 1 MB threshold every 8 MB buffer is a fresh mmap (~2,000 page faults each); inside
    heap_reuse the freed buffer stays at the heap's top and is reused. Counted in a fresh interpreter."""
    import subprocess

    outside, inside = map(int, subprocess.run([sys.executable, "-c", _REUSE_PROBE], capture_output=True, text=True,
                                              check=True).stdout.split())
    assert outside > 100 * 1500
    assert inside < outside / 5


_NESTED_PROBE = _REUSE_PROBE.replace("""with heap_reuse():
    inside = churn()""", """with heap_reuse():
    with heap_reuse():
        pass
    inside = churn()""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt exists on Linux only")
def test_a_nested_heap_reuse_leaves_the_outer_blocks_settings():
    """eval's decoder pass opens heap_reuse per window, maybe inside a caller's block: the inner exit must
    not put the 1 MB threshold back while the outer block runs."""
    import subprocess

    assert _NESTED_PROBE != _REUSE_PROBE
    outside, inside = map(int, subprocess.run([sys.executable, "-c", _NESTED_PROBE], capture_output=True, text=True,
                                              check=True).stdout.split())
    assert inside < outside / 5


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_a_packed_checkpoint_loads_on_a_meta_skeleton_and_lets_its_file_mapping_go(tiny_dir, text_file, tmp_path):
    """The loader builds the float architecture on the meta device (no float copy of the model), assigns the
    checkpoint's tensors, rebuilds the rotary buffers, and copies what it keeps out of the file's mapping."""
    import torch

    from geminicompress.models.loading import load_model
    from geminicompress.runtime.pipeline import RunOptions, run_recipe
    from geminicompress.runtime.recipes.loader import recipe_from_stage

    recipe = recipe_from_stage(str(tiny_dir), {"type": "quantize", "method": "rtn", "bits": 4, "group_size": 32},
                               {"data": str(text_file), "samples": 2, "seq_len": 64}, "test")
    run_recipe(recipe, tmp_path / "rtn", RunOptions(device=torch.device("cpu"), stream=False), loaded=load_model(str(tiny_dir)))
    loaded = load_model(str(tmp_path / "rtn"), tokenizer=False)
    assert loaded.tokenizer is None
    tensors = [*loaded.model.parameters(), *loaded.model.buffers()]
    assert tensors and not any(t.is_meta for t in tensors)
    rotary = next(m for n, m in loaded.model.named_modules() if n.endswith("rotary_emb"))
    fresh = type(rotary)(loaded.model.config)
    assert torch.equal(rotary.inv_freq, fresh.inv_freq)
    mapped = [line for line in open("/proc/self/maps") if str(tmp_path / "rtn") in line]
    assert mapped == []
    ids = torch.randint(0, 300, (1, 16))
    with torch.no_grad():
        assert torch.isfinite(loaded.model(ids).logits).all()
