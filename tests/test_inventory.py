"""Parameter-shape inventories (shapes/models/*.json) and dml_optim.inventory."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from dml_optim.inventory import Inventory, builtin_inventories, load_inventory, make_params

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
    # Synthetic inventories defined in shapes/models/generate.py.
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
