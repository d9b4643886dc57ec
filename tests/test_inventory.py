"""Parameter-shape inventories (dml_optim/data/shapes/models/*.json, installed with the package),
dml_optim.inventory, and resolve_model, the one resolver of model names every command uses."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dml_optim
from dml_optim.inventory import (
    Inventory,
    builtin_inventories,
    descriptors_dir,
    known_models,
    load_inventory,
    make_params,
    models_dir,
    resolve_model,
)

# Published parameter counts.
PUBLISHED_TOTALS = {
    # torchvision model docs, "num_params" in the weights table
    # (ResNet50_Weights.IMAGENET1K_V1/V2 meta in torchvision/models/resnet.py).
    "resnet50": 25_557_032,
    # torchvision model docs, "num_params" (ViT_B_16_Weights.IMAGENET1K_V1 meta in
    # torchvision/models/vision_transformer.py).
    "vit-b-16": 86_567_656,
    # BERT-base, ~110M in Devlin et al. 2019 (arXiv:1810.04805) and the bert-base-uncased model card;
    # the exact count of transformers.BertModel with pooler for that config is 109,482,240.
    "bert-base-uncased": 109_482_240,
    # GPT-2 small, "124M" on the gpt2 model card (the paper's 117M undercounts); exact count of
    # transformers.GPT2LMHeadModel with lm_head tied to wte (counted once) is 124,439,808.
    "gpt2": 124_439_808,
    # Synthetic inventories defined in tools/generate_inventories.py.
    "tiny-mlp": 4_522,
    "many-small": 2_000 * 1_024,
}


@pytest.fixture(scope="module")
def inventories() -> dict[str, Inventory]:
    return {name: load_inventory(path) for name, path in builtin_inventories().items()}


def test_builtin_inventories_are_all_present(inventories: dict[str, Inventory]) -> None:
    assert set(PUBLISHED_TOTALS) <= set(inventories)


@pytest.mark.parametrize("name", sorted(PUBLISHED_TOTALS))
def test_total_matches_published_figure(inventories: dict[str, Inventory], name: str) -> None:
    inv = inventories[name]
    assert inv.name == name  # file stem and "name" field agree
    assert inv.total_parameters == PUBLISHED_TOTALS[name]
    assert inv.numel == PUBLISHED_TOTALS[name]


def test_names_unique_and_shapes_positive(inventories: dict[str, Inventory]) -> None:
    for inv in inventories.values():
        names = [n for n, _ in inv.parameters]
        assert len(names) == len(set(names)), inv.name
        assert inv.num_tensors == len(names) > 0
        assert inv.source
        for n, shape in inv.parameters:
            assert all(isinstance(d, int) and d > 0 for d in shape), (inv.name, n, shape)


@pytest.mark.parametrize(
    ("model", "param", "shape"),
    [
        ("resnet50", "conv1.weight", (64, 3, 7, 7)),
        ("resnet50", "layer1.0.downsample.0.weight", (256, 64, 1, 1)),
        ("resnet50", "fc.weight", (1000, 2048)),
        ("bert-base-uncased", "embeddings.word_embeddings.weight", (30522, 768)),
        ("bert-base-uncased", "encoder.layer.11.intermediate.dense.weight", (3072, 768)),
        ("bert-base-uncased", "pooler.dense.weight", (768, 768)),
        ("gpt2", "transformer.wte.weight", (50257, 768)),
        ("gpt2", "transformer.wpe.weight", (1024, 768)),
        ("gpt2", "transformer.h.0.attn.c_attn.weight", (768, 2304)),  # Conv1D: [in, out]
        ("gpt2", "transformer.h.11.mlp.c_proj.weight", (3072, 768)),
        ("vit-b-16", "conv_proj.weight", (768, 3, 16, 16)),
        ("vit-b-16", "encoder.pos_embedding", (1, 197, 768)),
        ("vit-b-16", "encoder.layers.encoder_layer_0.self_attention.in_proj_weight", (2304, 768)),
        ("vit-b-16", "heads.head.weight", (1000, 768)),
        ("many-small", "t1999.weight", (1024,)),
    ],
)
def test_well_known_shapes(inventories: dict[str, Inventory], model: str, param: str, shape: tuple[int, ...]) -> None:
    assert dict(inventories[model].parameters)[param] == shape


def test_order_follows_named_parameters(inventories: dict[str, Inventory]) -> None:
    first = {name: [n for n, _ in inv.parameters[:3]] for name, inv in inventories.items()}
    assert first["resnet50"] == ["conv1.weight", "bn1.weight", "bn1.bias"]
    assert first["vit-b-16"] == ["class_token", "conv_proj.weight", "conv_proj.bias"]
    assert first["bert-base-uncased"][0] == "embeddings.word_embeddings.weight"
    assert first["gpt2"][:2] == ["transformer.wte.weight", "transformer.wpe.weight"]
    names = {n for n, _ in inventories["gpt2"].parameters}
    assert "lm_head.weight" not in names  # tied to transformer.wte.weight
    resnet = {n for n, _ in inventories["resnet50"].parameters}
    assert not any(n.endswith(("running_mean", "running_var", "num_batches_tracked")) for n in resnet)


# ----------------------------------------------------------------------------- load_inventory errors


def _write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "bad.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data), encoding="utf-8")
    return path


def _good() -> dict:
    return {
        "name": "m",
        "source": "test",
        "total_parameters": 7,
        "parameters": [{"name": "a.weight", "shape": [2, 3]}, {"name": "a.bias", "shape": [1]}],
    }


def test_load_inventory_accepts_good_file(tmp_path: Path) -> None:
    inv = load_inventory(_write(tmp_path, _good()))
    assert inv == Inventory("m", "test", 7, (("a.weight", (2, 3)), ("a.bias", (1,))))
    assert (inv.numel, inv.num_tensors) == (7, 2)


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d.pop("name"), "'name'"),
        (lambda d: d.update(total_parameters="7"), "'total_parameters'"),
        (lambda d: d.update(total_parameters=8), "'total_parameters'"),
        (lambda d: d.update(parameters={"a": [1]}), "'parameters'"),
        (lambda d: d["parameters"][1].update(shape=[0]), "'parameters[1].shape'"),
        (lambda d: d["parameters"][0].update(shape="2x3"), "'parameters[0].shape'"),
        (lambda d: d["parameters"][1].update(name="a.weight"), "'parameters[1].name'"),
        (lambda d: d["parameters"][0].pop("name"), "'parameters[0].name'"),
    ],
)
def test_load_inventory_rejects_malformed_file(tmp_path: Path, mutate, field: str) -> None:
    data = _good()
    mutate(data)
    path = _write(tmp_path, data)
    with pytest.raises(ValueError) as info:
        load_inventory(path)
    assert str(path) in str(info.value)
    assert field in str(info.value)


def test_load_inventory_rejects_invalid_json(tmp_path: Path) -> None:
    path = _write(tmp_path, "{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_inventory(path)


# ----------------------------------------------------------------------------- make_params


def test_make_params_shapes_dtype_and_determinism(inventories: dict[str, Inventory]) -> None:
    inv = inventories["tiny-mlp"]
    params = make_params(inv, dtype=torch.float64, generator=torch.Generator().manual_seed(0), scale=0.5)
    assert [tuple(p.shape) for p in params] == [s for _, s in inv.parameters]
    assert all(isinstance(p, torch.nn.Parameter) and p.dtype == torch.float64 and p.requires_grad for p in params)
    again = make_params(inv, dtype=torch.float64, generator=torch.Generator().manual_seed(0), scale=0.5)
    assert all(torch.equal(a, b) for a, b in zip(params, again))
    std = torch.cat([p.detach().flatten() for p in params]).std().item()
    assert math.isclose(std, 0.5, rel_tol=0.1)


def test_make_params_real_model_shapes(inventories: dict[str, Inventory]) -> None:
    inv = inventories["resnet50"]
    params = make_params(inv, generator=torch.Generator().manual_seed(1))
    assert [tuple(p.shape) for p in params] == [s for _, s in inv.parameters]
    assert sum(p.numel() for p in params) == inv.total_parameters


def test_make_params_rejects_integer_dtype(inventories: dict[str, Inventory]) -> None:
    with pytest.raises(ValueError, match="floating-point"):
        make_params(inventories["tiny-mlp"], dtype=torch.int32)


# ----------------------------------------------------------------------------- package data


def test_inventories_and_descriptors_are_package_data() -> None:
    package = Path(dml_optim.__file__).resolve().parent
    assert models_dir() == package / "data" / "shapes" / "models"
    assert descriptors_dir() == package / "data" / "shapes" / "descriptors"
    assert {p.parent for p in builtin_inventories().values()} == {models_dir()}
    assert (descriptors_dir() / "valid-minimal.json").is_file() and (descriptors_dir() / "README.md").is_file()
    # the data is not a Python package: nothing there would shadow the PyPI package named "shapes"
    assert not list((package / "data").rglob("__init__.py"))


def test_pyproject_installs_the_data() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    root = Path(__file__).resolve().parent.parent
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    globs = setuptools["package-data"]["dml_optim"]
    package = root / "dml_optim"
    for folder in (models_dir(), descriptors_dir()):
        for path in folder.iterdir():
            relative = path.relative_to(package)
            assert any(relative.match(g) for g in globs), f"{relative} is not package data"


# ----------------------------------------------------------------------------- resolve_model


@pytest.mark.parametrize("name", sorted(PUBLISHED_TOTALS))
def test_resolve_model_by_name(name: str) -> None:
    inv = resolve_model(name)
    assert inv.name == name and inv.total_parameters == PUBLISHED_TOTALS[name]


def test_resolve_model_by_path(tmp_path: Path, monkeypatch) -> None:
    assert resolve_model(builtin_inventories()["tiny-mlp"]) == resolve_model("tiny-mlp")
    path = _write(tmp_path, _good())
    assert resolve_model(str(path)).name == "m"
    monkeypatch.chdir(tmp_path)
    assert resolve_model("bad.json").name == "m"  # relative to the working directory
    (tmp_path / "my-model").write_text(json.dumps(_good()))
    assert resolve_model("my-model").name == "m"  # no built-in of that name: the file


@pytest.mark.parametrize(("name", "tensors", "elements"), [
    ("many-small-3", 3, 3 * 1024),
    ("one-2k", 1, 2 * 2**10),
    ("one-64m", 1, 2**26),
])
def test_resolve_model_synthetic(name: str, tensors: int, elements: int) -> None:
    inv = resolve_model(name)
    assert (inv.name, inv.num_tensors, inv.numel, inv.total_parameters) == (name, tensors, elements, elements)
    assert inv.source.startswith("synthetic")


def test_many_small_is_the_built_in_file_and_many_small_n_the_same_layout() -> None:
    assert resolve_model("many-small").parameters[:3] == resolve_model("many-small-3").parameters


@pytest.mark.parametrize("spec", ["resnet", "no-such-model", "many-small-0", "one-5g", "missing/model.json", "x.json"])
def test_resolve_model_unknown_is_one_line_listing_the_names(spec: str) -> None:
    with pytest.raises(ValueError) as info:
        resolve_model(spec)
    message = str(info.value)
    assert "\n" not in message and repr(spec) in message
    for name in known_models():
        assert name in message


def test_resolve_model_bad_file_names_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "{not json")
    with pytest.raises(ValueError, match="not valid JSON") as info:
        resolve_model(path)
    assert str(path) in str(info.value)


def test_known_models() -> None:
    assert known_models()[:6] == sorted(PUBLISHED_TOTALS)
    assert known_models()[6:] == ["many-small-N", "one-Nk", "one-Nm"]


def test_the_maintainer_script_writes_the_package_data() -> None:
    # tools/generate_inventories.py rebuilds dml_optim/data/shapes/models from architecture definitions
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, str(root / "tools" / "generate_inventories.py"), "--check"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.splitlines()) == len(PUBLISHED_TOTALS)
