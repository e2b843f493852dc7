"""The output folder's modes follow the umask, whatever mode a library wrote a file with."""

import os
import stat

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from geminicompress.cli import app
from geminicompress.host.output import OutputDir


@pytest.fixture
def umask():
    saved = os.umask(0o022)
    yield lambda mask: os.umask(mask)
    os.umask(saved)


def _modes(root):
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            found[os.path.relpath(path, root)] = stat.S_IMODE(os.stat(path).st_mode)
    return found


@pytest.mark.parametrize("mask,file_mode,dir_mode", [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700), (0o002, 0o664, 0o775)])
def test_files_get_the_umask_mode_when_out_is_complete(tmp_path, umask, mask, file_mode, dir_mode):
    umask(mask)
    out = tmp_path / "out"
    with OutputDir(out) as tmp:
        save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))
        (tmp / "sub").mkdir(mode=0o700)
        (tmp / "sub" / "x.txt").write_text("x")
        os.chmod(tmp / "sub" / "x.txt", 0o600)
    modes = _modes(out)
    assert set(modes) == {"model.safetensors", "sub", "sub/x.txt"}
    assert modes["model.safetensors"] == modes["sub/x.txt"] == file_mode
    assert modes["sub"] == dir_mode and stat.S_IMODE(os.stat(out).st_mode) == dir_mode


def test_a_written_checkpoint_is_readable_by_others_under_umask_022(tiny_dir, tmp_path, umask):
    umask(0o022)
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["quantize", str(tiny_dir), "-o", str(out), "--method", "int8", "-q"])
    assert res.exit_code == 0, res.output
    modes = _modes(out)
    assert "model.safetensors" in modes
    assert {m for name, m in modes.items() if (out / name).is_file()} == {0o644}
