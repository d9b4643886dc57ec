"""Rebuild the parameter-shape inventories (``dml_optim/data/shapes/models``) from architecture definitions.

Each model below is a parameter skeleton written in plain ``torch.nn``: the same
module tree, attribute names and registration order as the real implementation
(torchvision, Hugging Face transformers), so ``named_parameters()`` yields the
real state_dict names in the real order. The skeletons have no ``forward``; they
exist only to be counted. They are built on the ``meta`` device, so nothing is
allocated.

A maintainer script, not part of the package: the JSON files it writes are
package data, installed with dml_optim and read with ``importlib.resources``.

Usage (from the repository root)::

    python3 tools/generate_inventories.py           # rewrite the *.json files
    python3 tools/generate_inventories.py --check   # exit 1 if a file is out of date

Needs only the standard library and torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Callable

import torch
from torch import nn

MODELS_DIR = Path(__file__).resolve().parent.parent / "dml_optim" / "data" / "shapes" / "models"


# --------------------------------------------------------------------------- resnet50
# torchvision/models/resnet.py: ResNet(Bottleneck, [3, 4, 6, 3]).


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        width = planes  # groups=1, base_width=64
        self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample


class ResNet(nn.Module):
    def __init__(self, layers: list[int], num_classes: int = 1000) -> None:
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = self._make_layer(64, layers[0])
        self.layer2 = self._make_layer(128, layers[1], stride=2)
        self.layer3 = self._make_layer(256, layers[2], stride=2)
        self.layer4 = self._make_layer(512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * Bottleneck.expansion, num_classes)

    def _make_layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * Bottleneck.expansion:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes * Bottleneck.expansion, 1, stride=stride, bias=False),
                nn.BatchNorm2d(planes * Bottleneck.expansion),
            )
        layers = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * Bottleneck.expansion
        layers += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)


# --------------------------------------------------------------------------- vit-b-16
# torchvision/models/vision_transformer.py: VisionTransformer(image_size=224, patch_size=16,
# num_layers=12, num_heads=12, hidden_dim=768, mlp_dim=3072), no representation layer.


class MLPBlock(nn.Sequential):
    # torchvision.ops.MLP layout: Linear, GELU, Dropout, Linear, Dropout -> "mlp.0", "mlp.3".
    def __init__(self, dim: int, mlp_dim: int) -> None:
        super().__init__(nn.Linear(dim, mlp_dim), nn.GELU(), nn.Dropout(), nn.Linear(mlp_dim, dim), nn.Dropout())


class EncoderBlock(nn.Module):
    def __init__(self, num_heads: int, hidden_dim: int, mlp_dim: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden_dim, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(hidden_dim, num_heads, batch_first=True)
        self.dropout = nn.Dropout()
        self.ln_2 = nn.LayerNorm(hidden_dim, eps=1e-6)
        self.mlp = MLPBlock(hidden_dim, mlp_dim)


class Encoder(nn.Module):
    def __init__(self, seq_length: int, num_layers: int, num_heads: int, hidden_dim: int, mlp_dim: int) -> None:
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.empty(1, seq_length, hidden_dim))
        self.dropout = nn.Dropout()
        self.layers = nn.Sequential(
            OrderedDict(
                (f"encoder_layer_{i}", EncoderBlock(num_heads, hidden_dim, mlp_dim)) for i in range(num_layers)
            )
        )
        self.ln = nn.LayerNorm(hidden_dim, eps=1e-6)


class VisionTransformer(nn.Module):
    def __init__(
        self,
        image_size: int = 224,
        patch_size: int = 16,
        num_layers: int = 12,
        num_heads: int = 12,
        hidden_dim: int = 768,
        mlp_dim: int = 3072,
        num_classes: int = 1000,
    ) -> None:
        super().__init__()
        self.conv_proj = nn.Conv2d(3, hidden_dim, patch_size, stride=patch_size)
        seq_length = (image_size // patch_size) ** 2 + 1  # + class token
        # Registered on the root module, so named_parameters() lists it first.
        self.class_token = nn.Parameter(torch.zeros(1, 1, hidden_dim))
        self.encoder = Encoder(seq_length, num_layers, num_heads, hidden_dim, mlp_dim)
        self.heads = nn.Sequential(OrderedDict(head=nn.Linear(hidden_dim, num_classes)))


# --------------------------------------------------------------------------- bert-base-uncased
# transformers/models/bert/modeling_bert.py: BertModel(config, add_pooling_layer=True).


class BertEmbeddings(nn.Module):
    def __init__(self, vocab: int, hidden: int, max_position: int, type_vocab: int) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden, padding_idx=0)
        self.position_embeddings = nn.Embedding(max_position, hidden)
        self.token_type_embeddings = nn.Embedding(type_vocab, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=1e-12)
        self.dropout = nn.Dropout(0.1)


class BertSelfAttention(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.dropout = nn.Dropout(0.1)


class BertDenseNorm(nn.Module):
    """BertSelfOutput / BertOutput: dense, LayerNorm, dropout."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.dense = nn.Linear(d_in, d_out)
        self.LayerNorm = nn.LayerNorm(d_out, eps=1e-12)
        self.dropout = nn.Dropout(0.1)


class BertAttention(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.self = BertSelfAttention(hidden)
        self.output = BertDenseNorm(hidden, hidden)


class BertIntermediate(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, intermediate)


class BertLayer(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.attention = BertAttention(hidden)
        self.intermediate = BertIntermediate(hidden, intermediate)
        self.output = BertDenseNorm(intermediate, hidden)


class BertEncoder(nn.Module):
    def __init__(self, layers: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(hidden, intermediate) for _ in range(layers))


class BertPooler(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.activation = nn.Tanh()


class BertModel(nn.Module):
    def __init__(
        self,
        vocab: int = 30522,
        hidden: int = 768,
        layers: int = 12,
        intermediate: int = 3072,
        max_position: int = 512,
        type_vocab: int = 2,
    ) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings(vocab, hidden, max_position, type_vocab)
        self.encoder = BertEncoder(layers, hidden, intermediate)
        self.pooler = BertPooler(hidden)


# --------------------------------------------------------------------------- gpt2
# transformers/models/gpt2/modeling_gpt2.py: GPT2LMHeadModel, lm_head tied to transformer.wte.


class Conv1D(nn.Module):
    """transformers.pytorch_utils.Conv1D: a linear layer with its weight stored as [in, out]."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.empty(nf))


class GPT2Attention(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_attn = Conv1D(3 * n_embd, n_embd)
        self.c_proj = Conv1D(n_embd, n_embd)


class GPT2MLP(nn.Module):
    def __init__(self, n_embd: int, n_inner: int) -> None:
        super().__init__()
        self.c_fc = Conv1D(n_inner, n_embd)
        self.c_proj = Conv1D(n_embd, n_inner)


class GPT2Block(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, eps=1e-5)
        self.attn = GPT2Attention(n_embd)
        self.ln_2 = nn.LayerNorm(n_embd, eps=1e-5)
        self.mlp = GPT2MLP(n_embd, 4 * n_embd)


class GPT2Model(nn.Module):
    def __init__(self, n_vocab: int, n_positions: int, n_embd: int, n_layer: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(n_vocab, n_embd)
        self.wpe = nn.Embedding(n_positions, n_embd)
        self.drop = nn.Dropout(0.1)
        self.h = nn.ModuleList(GPT2Block(n_embd) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, eps=1e-5)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, n_vocab: int = 50257, n_positions: int = 1024, n_embd: int = 768, n_layer: int = 12) -> None:
        super().__init__()
        self.transformer = GPT2Model(n_vocab, n_positions, n_embd, n_layer)
        self.lm_head = nn.Linear(n_embd, n_vocab, bias=False)
        # Tied: named_parameters() de-duplicates, so lm_head.weight is not listed.
        self.lm_head.weight = self.transformer.wte.weight


# --------------------------------------------------------------------------- small synthetic


def tiny_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


class _Leaf(nn.Module):
    def __init__(self, numel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(numel))


def many_small(count: int = 2000, numel: int = 1024) -> nn.Module:
    return nn.ModuleDict({f"t{i:04d}": _Leaf(numel) for i in range(count)})


# --------------------------------------------------------------------------- registry

# name -> (builder, source description)
MODELS: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "resnet50": (
        lambda: ResNet([3, 4, 6, 3]),
        "torchvision.models.resnet50 (Bottleneck blocks [3, 4, 6, 3], ImageNet head, 1000 classes); "
        "names and shapes checked against torchvision 0.29.1; BatchNorm running stats are buffers, not listed",
    ),
    "vit-b-16": (
        VisionTransformer,
        "torchvision.models.vit_b_16 (image 224, patch 16, 12 layers, 12 heads, hidden 768, mlp 3072, "
        "ImageNet head, 1000 classes); names and shapes checked against torchvision 0.29.1",
    ),
    "bert-base-uncased": (
        BertModel,
        "Hugging Face transformers BertModel with pooler (bert-base-uncased config: vocab 30522, hidden 768, "
        "12 layers, 12 heads, intermediate 3072, max_position 512, type_vocab 2); "
        "names and shapes checked against transformers 5.23.0",
    ),
    "gpt2": (
        GPT2LMHeadModel,
        "Hugging Face transformers GPT2LMHeadModel (gpt2 124M config: n_vocab 50257, n_positions 1024, "
        "n_embd 768, n_layer 12, n_head 12); lm_head.weight is tied to transformer.wte.weight and listed once; "
        "attention/MLP weights are Conv1D, stored [in, out]; names and shapes checked against transformers 5.23.0",
    ),
    "tiny-mlp": (
        tiny_mlp,
        "torch.nn.Sequential(Linear(32, 64), ReLU, Linear(64, 32), ReLU, Linear(32, 10)); synthetic, for quick tests",
    ),
    "many-small": (
        many_small,
        "synthetic: 2000 tensors of 1024 elements each (t0000.weight .. t1999.weight); "
        "benchmark extreme for per-tensor overhead",
    ),
}


def inventory(name: str) -> dict:
    """Build model ``name`` on the meta device and return its inventory as a JSON-ready dict."""
    builder, source = MODELS[name]
    with torch.device("meta"):
        model = builder()
    params = [{"name": n, "shape": list(p.shape)} for n, p in model.named_parameters()]
    total = sum(p.numel() for p in model.parameters())
    return {"name": name, "source": source, "total_parameters": total, "parameters": params}


def render(inv: dict) -> str:
    """JSON text with one parameter per line (diff-friendly)."""
    head = {k: v for k, v in inv.items() if k != "parameters"}
    lines = ["{"]
    lines += [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    lines.append('  "parameters": [')
    rows = [f'    {{"name": {json.dumps(p["name"])}, "shape": {json.dumps(p["shape"])}}}' for p in inv["parameters"]]
    lines.append(",\n".join(rows))
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if any file differs")
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"models to build (default: all of {', '.join(MODELS)})")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in MODELS]
    if unknown:
        parser.error(f"unknown model(s): {', '.join(unknown)}")
    stale = []
    for name in args.names or MODELS:
        inv = inventory(name)
        path = MODELS_DIR / f"{name}.json"
        text = render(inv)
        assert json.loads(text) == inv
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(path.name)
        else:
            path.write_text(text, encoding="utf-8")
        print(f"{name:20s} {len(inv['parameters']):5d} tensors {inv['total_parameters']:>12,d} parameters")
    if stale:
        print("out of date: " + ", ".join(stale) + " (run tools/generate_inventories.py)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
