"""Issue 53, items 8, 9 and 10, on copies of the bundled pack: verify (and every load)
catches each lie that used to pass (records, layer lists or tensor names swapped with
their checksums, a changed vocabulary or generation config, a manifest at odds with
config.json); a damaged mlx-lm header is one line in doctor, generate and verify alike;
`convert --overwrite` removes only what its manifest says it wrote."""

import json
import os
import shutil
import struct
from pathlib import Path

import pytest

from edgemoe.format.pack import MANIFEST, Pack
from edgemoe.format.source import BUNDLED_MODEL

from conftest import error_line, tool_module

verify, generate, doctor = (tool_module(n) for n in ("verify", "generate", "doctor"))
BIG = ("experts.bin", "model.safetensors")


def bundled_copy(tmp_path: Path) -> Path:
    """A copy of the bundled pack; its weights hard-linked (no test here writes them)."""
    out = tmp_path / "pack"
    shutil.copytree(BUNDLED_MODEL, out, ignore=shutil.ignore_patterns(*BIG, "traces"))
    for name in BIG:
        os.link(BUNDLED_MODEL / name, out / name)
    return out


def edit_manifest(pack: Path, change):
    m = json.loads((pack / MANIFEST).read_text())
    change(m)
    (pack / MANIFEST).write_text(json.dumps(m, indent=1))


def unbound(m):
    """The manifest as edgemoe wrote it before records were bound and files listed."""
    m.pop("files", None)
    for layer in m["layers"]:
        layer["records"] = [r[:3] for r in layer["records"]]


def swap_records(m):
    r = m["layers"][3]["records"]
    r[1], r[2] = r[2], r[1]  # offsets, lengths, CRCs and all


def swap_layer_lists(m):
    a, b = m["layers"][2], m["layers"][5]
    a["records"], b["records"] = b["records"], a["records"]


def swap_tensor_names(m):
    tensors = {t["name"]: t for t in m["layers"][0]["tensors"]}
    gate, up = tensors["gate_proj.weight"], tensors["up_proj.weight"]
    gate["name"], up["name"] = "up_proj.weight", "gate_proj.weight"


@pytest.mark.parametrize("lie, expected", [
    (swap_records, "layer 3 expert 1: its checksum is not bound to this expert"),
    (swap_layer_lists, "layer 2 expert 0: its checksum is not bound to this expert"),
    (swap_tensor_names, "layer 0 expert 0: its checksum is not bound to this expert"),
])
def test_records_moved_with_their_checksums_fail_verify_and_load(tmp_path, lie, expected):
    pack = bundled_copy(tmp_path)
    edit_manifest(pack, lie)
    assert expected in error_line(verify.main, "--model", pack)
    assert expected in error_line(generate.main, "--model", pack, "--prompt", "hi",
                                  "--max-tokens", "1")


def swap_two_tokens(pack: Path):
    tokenizer = json.loads((pack / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (pack / "tokenizer.json").write_text(json.dumps(tokenizer))


def change_generation_config(pack: Path):
    config = json.loads((pack / "generation_config.json").read_text())
    (pack / "generation_config.json").write_text(json.dumps(dict(config, temperature=1.7)))


@pytest.mark.parametrize("change, name", [(swap_two_tokens, "tokenizer.json"),
                                          (change_generation_config, "generation_config.json")])
def test_files_that_change_the_output_are_checksummed(tmp_path, change, name):
    pack = bundled_copy(tmp_path)
    change(pack)
    line = error_line(verify.main, "--model", pack)
    assert f"{pack / name}: checksum mismatch" in line and "changes the output" in line


def top_k_1000(m):
    m["top_k"] = 1000


def sixteen_records(m):
    for layer in m["layers"]:
        layer["records"] = layer["records"][:16]


def bits_8(m):
    m["layers"][1]["quantization"]["gate_proj"]["bits"] = 8


def relabel(kind, dtype):
    def change(m):
        for t in m["layers"][4]["tensors"]:
            if t["name"] == f"up_proj.{kind}":
                t["dtype"] = dtype
    return change


@pytest.mark.parametrize("lie, expected", [
    (top_k_1000, "{cfg}: routes 8 experts per token, the pack was written for 1000"),
    (sixteen_records, "layer 0: 16 expert records, {cfg} has 128 experts (num_experts)"),
    (bits_8, "layer 1 gate_proj: quantization bits 8, {cfg} says 4"),
    (relabel("scales", "int32"), "layer 4 up_proj.scales: dtype int32, expected one of"),
    (relabel("weight", "float32"), "layer 4 up_proj.weight: dtype float32, expected uint32"),
])
@pytest.mark.parametrize("bound", [True, False], ids=["bound", "older-pack"])
def test_a_manifest_at_odds_with_the_config_fails_verify(tmp_path, lie, expected, bound):
    """Also on a pack written before records were bound (where the binding does not
    catch them first): the config check alone."""
    pack = bundled_copy(tmp_path)
    edit_manifest(pack, lie if bound else lambda m: (unbound(m), lie(m)))
    line = error_line(verify.main, "--model", pack)
    if bound and (lie is bits_8 or "dtype" in expected):
        assert "its checksum is not bound" in line, line  # the binding catches it first
    else:
        assert expected.format(cfg=pack / "config.json") in line, line


def test_an_older_pack_still_opens_and_verify_says_what_it_does_not_check(tmp_path, capsys):
    pack = bundled_copy(tmp_path)
    edit_manifest(pack, unbound)
    verify.main(["--model", str(pack)])
    out = capsys.readouterr().out
    assert "ok (1024 expert records" in out and "note: written before edgemoe bound" in out
    verify.main(["--model", str(BUNDLED_MODEL)])
    out = capsys.readouterr().out
    assert "records bound to their layer, expert and tensors; 4 files checksummed" in out
    assert "note" not in out
    assert Pack.open(pack).fingerprint == Pack.open(BUNDLED_MODEL).fingerprint  # traces


def test_a_zero_shape_in_the_manifest_is_one_line(tmp_path):
    pack = bundled_copy(tmp_path)

    def zero(m):
        unbound(m)
        m["layers"][0]["tensors"][0]["shape"] = [0, 1]
        m["layers"][0]["tensors"][0]["nbytes"] = 0
    edit_manifest(pack, zero)
    assert "shape [0, 1]: an expert tensor holds at least one value" in error_line(
        verify.main, "--model", pack)


# --- item 9: a damaged mlx-lm checkpoint's header, read in place ----------------------

def rewrite_header(path: Path, change):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    change(header)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


UP = "model.layers.1.mlp.switch_mlp.up_proj.weight"  # U32 (16, 64, 8): 32768 bytes


def as_dtype(dtype, shape):
    def change(header):
        header[UP].update(dtype=dtype, shape=shape)
    return change


def empty(header):
    begin = header[UP]["data_offsets"][0]
    header[UP].update(shape=[0, 64, 8], data_offsets=[begin, begin])


@pytest.mark.parametrize("change, expected", [
    (as_dtype("F64", [16, 64, 4]), "expert dtype F64, expected one of U32"),
    (as_dtype("BOOL", [16, 64, 32]), "expert dtype BOOL, expected one of U32"),
    (as_dtype("U32", [64, 64, 2]), "64 experts, config.json has 16"),
    (empty, "shape [0, 64, 8], expected (experts, ...) with no empty dimension"),
])
def test_a_damaged_expert_header_is_the_same_line_in_every_tool(tiny_mlx_checkpoint,
                                                                 tmp_path, change, expected):
    model = shutil.copytree(tiny_mlx_checkpoint, tmp_path / "mlx")
    rewrite_header(model / "model.safetensors", change)
    where = f"{model / 'model.safetensors'}: tensor {UP.rsplit('.', 2)[0]}"
    lines = [error_line(doctor.main, "--model", model, "--memory", "8GB"),
             error_line(generate.main, "--model", model, "--prompt", "hi", "--max-tokens", "1"),
             error_line(verify.main, "--model", model)]
    for line in lines:
        assert where in line and expected in line, line


# --- item 9: the pack's own chat template in generate, bounded as the server's ---------

@pytest.mark.parametrize("template, expected", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
     "its chat template took over 0.5 s to render; the render was stopped"),
    ("{{ ''.__class__.__mro__ }}", "its chat template cannot render this prompt: "
                                   "SecurityError: access to attribute '__class__'"),
])
def test_the_models_own_chat_template_is_bounded_in_generate(tiny_mlx_checkpoint, tmp_path,
                                                              monkeypatch, template, expected):
    from edgemoe.serving import templates

    monkeypatch.setattr(templates.POLICY, "timeout_s", 0.5)
    model = shutil.copytree(tiny_mlx_checkpoint, tmp_path / "mlx")
    (model / "chat_template.jinja").write_text(template)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    line = error_line(generate.main, "--model", model, "--prompt", "hi", "--max-tokens", "1")
    assert f"{model}: {expected}" in line, line


# --- item 10: --overwrite removes only what convert wrote -----------------------------

def test_overwrite_keeps_user_files_whose_names_look_like_ours(tiny_mlx_checkpoint, tmp_path):
    from edgemoe.convert import convert

    dst = convert(tiny_mlx_checkpoint, tmp_path / "pack")
    (dst / "tokenizer_notes.md").write_text("my notes")
    (dst / "vocab.backup").write_text("my backup")
    (dst / "merges.txt.orig").write_text("mine")
    convert(tiny_mlx_checkpoint, dst, overwrite=True)
    assert (dst / "tokenizer_notes.md").read_text() == "my notes"
    assert (dst / "vocab.backup").read_text() == "my backup"
    assert (dst / "merges.txt.orig").read_text() == "mine"
    written = json.loads((dst / MANIFEST).read_text())["files"]  # what the next one removes
    assert {"tokenizer.json", "experts.bin", "config.json"} <= set(written)
    assert written["tokenizer.json"] and written["experts.bin"] is None
    assert "tokenizer_notes.md" not in written
    Pack.open(dst)


def test_overwrite_of_an_older_pack_keeps_user_files_too(tiny_mlx_checkpoint, tmp_path):
    from edgemoe.convert import convert

    dst = convert(tiny_mlx_checkpoint, tmp_path / "pack")
    edit_manifest(dst, unbound)  # as written before the list
    (dst / "tokenizer_notes.md").write_text("my notes")
    (dst / "vocab.backup").write_text("my backup")
    convert(tiny_mlx_checkpoint, dst, overwrite=True)
    assert (dst / "tokenizer_notes.md").exists() and (dst / "vocab.backup").exists()
