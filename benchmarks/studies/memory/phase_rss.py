"""Where a command's memory peak is: run a geminicompress command in this process, sample its resident memory
every 20 ms, and label each sample with the phase it fell in (capture, the one calibration pass, each GPTQ
solve and inverse factor, finishing and writing a layer, the modules outside the layers, the check of OUT).

  python benchmarks/studies/memory/phase_rss.py quantize /work/synth8b-1l -o SCRATCH/out --stream --force -q \\
      --method gptq --bits 4 --group-size 128 --samples 32 --calib-seq-len 512 --data ../shared/data/enwiki-sample.txt

Prints, in time order, every phase entry (>name) and exit (<name) and every move of more than 100 MB, as
"seconds GiB phase", then the peak and the phase it fell in. A diagnostic, not a benchmark: whole-process
peaks for the bars come from `/usr/bin/time -v` (stream_bench.py). Run it alone: the sampler thread
itself is cheap, but other processes change the heap's layout and the timings.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time

PAGE = os.sysconf("SC_PAGE_SIZE")
phase = ["start"]
peak: list = [0, "", 0.0]
log: list[tuple[float, float, str]] = []
t0 = time.time()


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def _note(label: str) -> None:
    log.append((round(time.time() - t0, 1), round(rss() / 2**30, 3), label))


def sampler() -> None:
    last = 0
    while True:
        r = rss()
        if r > peak[0]:
            peak[:] = [r, phase[0], time.time() - t0]
        if abs(r - last) > 100 << 20:
            _note(phase[0])
            last = r
        time.sleep(0.02)


def wrap(owner: object, name: str, label: str) -> None:
    """Label the time spent inside owner.name (a function or a method)."""
    orig = getattr(owner, name)

    @functools.wraps(orig)
    def labelled(*args, **kwargs):
        prev = phase[0]
        phase[0] = label
        _note(f">{label}")
        try:
            return orig(*args, **kwargs)
        finally:
            _note(f"<{label}")
            phase[0] = prev

    setattr(owner, name, labelled)


def main() -> None:
    import geminicompress.compress.gptq.solver as solver
    import geminicompress.compress.gptq.stage as gstage
    import geminicompress.engine.export as export
    import geminicompress.engine.verify as verify
    import geminicompress.engine.walk as walk
    import geminicompress.formats.shards as shards
    import geminicompress.formats.writer as writer
    import geminicompress.runtime.pipeline as pipeline
    from geminicompress.cli import main as cli
    from geminicompress.engine.sinks import ResidentSink, ShardSink

    wrap(walk, "_capture", "capture")
    wrap(walk, "_one_layer", "one_layer")
    wrap(gstage, "gptq_quantize", "gptq_quantize")
    wrap(solver, "inverse_hessian_factor", "inverse_factor")
    wrap(walk, "walk_outside", "walk_outside")
    wrap(pipeline, "_in_memory", "in_memory_stages")
    wrap(export, "finish_export", "finish_out")
    wrap(verify.Probe, "check", "verify_check")
    wrap(verify, "loaded_logits", "verify_load_back")
    wrap(verify.Probe, "advance", "probe_advance")
    wrap(ResidentSink, "finish", "resident_finish")
    wrap(ShardSink, "finish", "shard_finish")
    wrap(writer.PackedWriter, "layer_tensors", "layer_tensors")
    wrap(shards.ShardWriter, "write", "writer_write")
    run_sampled(cli)


def run_sampled(cli) -> None:
    """Run the CLI on this script's arguments with the RSS sampler on; print each phase's row and the peak."""
    threading.Thread(target=sampler, daemon=True).start()
    sys.argv = ["geminicompress", *sys.argv[1:]]
    try:
        cli()
    except SystemExit:
        pass
    finally:
        for row in log:
            print(*row)
        print(f"PEAK {peak[0] / 2**30:.3f} GiB in phase {peak[1]} at {peak[2]:.1f}s")


if __name__ == "__main__":
    main()
