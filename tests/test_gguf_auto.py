"""`quantize --format gguf --gguf-type auto --target-size-mb MB`: each linear's GGUF type chosen by its measured
sensitivity under the file's size (gptq's allocation over `gguf:<TYPE>` options); the file holds our weights bit
for bit, lands on the size, and a size no choice of types reaches is one line, exit 2, before any work."""

import json

import pytest
import torch
from gguf import GGUFReader
from typer.testing import CliRunner

from geminicompress.cli import app
from geminicompress.compress.sensitivity.options import parse_option
from geminicompress.core.errors import InputError
from test_gguf_type import _check_file_is_the_checkpoint, _run, wide_dir  # noqa: F401 (the fixture)


def test_gguf_options_cost_their_blocks_and_hold_only_rows_their_block_divides():
    q4k, iq4 = parse_option("gguf:q4_k"), parse_option("gguf:IQ4_NL")
    assert q4k.label == "gguf:Q4_K" and q4k.bits_per_weight(256) == 4.5 and parse_option("gguf:Q2_K").bits_per_weight(256) == 2.625
    assert q4k.applies(512) and not q4k.applies(320) and iq4.applies(320) and q4k.needs_hessian
    with pytest.raises(InputError, match="GGUF tensor type"):
        parse_option("gguf:Q7_K")


@pytest.fixture(scope="module")
def sized(wide_dir, text_file, tmp_path_factory):  # noqa: F811
    """Two auto files of the wide tiny model: a small budget (its table measured), a large one (the table reused)."""
    out, table = {}, {}
    for size in (0.5, 0.8):
        folder = tmp_path_factory.mktemp("auto") / f"o{size}"
        report = _run(wide_dir, folder, text_file, method="gptq", gguf_type="auto",
                      allocation={"target_size_mb": size, **table})
        table = {"sensitivity": str(folder / "sensitivity.json")}
        out[size] = (folder, report)
    return out


def test_auto_lands_on_the_size_and_holds_our_weights_bit_for_bit(sized):
    for size, (folder, report) in sized.items():
        real = (folder / "model.gguf").stat().st_size / 1e6
        plan = json.loads((folder / "allocation.json").read_text())
        assert real <= size * 1.005 and real >= size * 0.95, (size, real)  # the metadata is estimated
        assert abs(plan["predicted_size_mb"] - real) / real < 0.02, (plan["predicted_size_mb"], real)
        types = _check_file_is_the_checkpoint(folder)
        assert all(types[k] == t for k, t in _gguf_names(plan["modules"]).items()), (plan["modules"], types)
        assert {types[f"blk.{i}.ffn_down.weight"] for i in (0, 1)} <= {"IQ4_NL", "Q5_0", "Q8_0"}  # 320 wide: 32-blocks
        assert report["stages"][0]["result"]["gguf_type"] == "AUTO"
    small = json.loads((sized[0.5][0] / "allocation.json").read_text())
    large = json.loads((sized[0.8][0] / "allocation.json").read_text())
    assert small["predicted_kl"] > large["predicted_kl"] and small["average_bits"] < large["average_bits"]
    assert len(set(small["modules"].values())) >= 2  # a mix, not one type
    names = {t.name for t in GGUFReader(str(sized[0.5][0] / "model.gguf")).tensors}
    assert "token_embd.weight" in names and "output.weight" not in names  # tied: the head is the embedding


def _gguf_names(modules: dict[str, str]) -> dict[str, str]:
    """model.layers.N.self_attn.q_proj -> blk.N.attn_q.weight (the tiny llama's linears)."""
    short = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    return {f"blk.{m.split('.')[2]}.{short[m.split('.', 3)[3]]}.weight": t for m, t in modules.items()}


def test_auto_bad_input_is_one_line_exit_2_before_any_work(wide_dir, tmp_path):  # noqa: F811
    def cli(*extra):
        return CliRunner().invoke(app, ["quantize", str(wide_dir), "-o", str(tmp_path / "o"), "--method", "gptq",
                                        "--format", "gguf", "--gguf-type", "auto", "--quiet", *extra])

    for extra, says in [((), "needs a budget"), (("--target-size-mb", "5"), "cannot be met"),
                        (("--target-size-mb", "0.6", "--allocation-options", "gguf:Q4_K,gguf:Q6_K"), "holds"),
                        (("--target-size-mb", "0.6", "--allocation-options", "gptq:b4g64"), "gguf:<TYPE>")]:
        res = cli(*extra)
        assert res.exit_code == 2 and says in res.output and len(res.output.strip().splitlines()) == 1, (extra, res.output)
        assert not (tmp_path / "o").exists()
