"""The course's models: the reference notes' MNIST CNN, ResNet-18 and a
GPT-style transformer with size presets.

Every model keeps the :class:`ShardUnits` protocol: ``shard_units()`` lists
the submodules a sharding strategy wraps one by one (each becomes one
all-gather in forward and one reduce-scatter in backward), and
``init_weights()`` initialises every parameter and buffer in place, so a
model built on the ``meta`` device can be sharded first and materialised
afterwards (:func:`distlab.parallel.materialize.materialize`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Protocol, runtime_checkable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .errors import DistlabError


@runtime_checkable
class ShardUnits(Protocol):
    """What a model offers the sharding strategies."""

    def shard_units(self) -> list[nn.Module]:
        """Submodules to shard one by one, in forward order; the rest goes with the root."""
        ...

    def init_module(self, module: nn.Module) -> None:
        """Initialise ``module``'s own parameters and buffers (not its children's) in place,
        drawing from the global RNG; :func:`init_weights` calls it on every module in order."""
        ...


def init_weights(model: nn.Module) -> None:
    """(Re-)initialise every parameter and buffer of a :class:`ShardUnits` model in place."""
    for module in model.modules():
        model.init_module(module)


def require_shard_units(model: nn.Module, strategy: str) -> list[nn.Module]:
    """The model's shard units, or one sentence on why a sharding strategy cannot use it."""
    if not isinstance(model, ShardUnits):
        raise DistlabError(
            f"strategy {strategy} shards a model unit by unit, but {type(model).__name__} has no shard_units(): "
            "give it shard_units() and init_weights() (see distlab.models.ShardUnits)"
        )
    return model.shard_units()


def reset_module(module: nn.Module) -> None:
    """torch's own default initialisation of one layer."""
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()


class MnistCNN(nn.Module):
    """Three 5x5 conv layers (1->32->64->128, each followed by ReLU and 2x2
    max-pool: 28->14->7->3) and two linear layers (1152->128->10)."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        side = image_size // 8
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(128 * side * side, 128), nn.ReLU(), nn.Linear(128, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))

    def shard_units(self) -> list[nn.Module]:
        return [self.features[0], self.features[3], self.features[6], self.classifier[1], self.classifier[3]]

    def init_module(self, module: nn.Module) -> None:
        reset_module(module)


@cache
def resnet18_class() -> type[nn.Module]:
    """``ResNet18``, defined on first use: importing torchvision's models costs every rank process
    seconds, and most runs never build a ResNet."""
    from torchvision.models.resnet import BasicBlock, ResNet

    class ResNet18(ResNet):
        """torchvision's ResNet-18, first conv adapted to the input's channels;
        its four residual stages are the shard units."""

        def __init__(self, in_channels: int = 3, num_classes: int = 10):
            super().__init__(BasicBlock, [2, 2, 2, 2], num_classes=num_classes)
            if in_channels != 3:
                self.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)

        def shard_units(self) -> list[nn.Module]:
            return [self.layer1, self.layer2, self.layer3, self.layer4]

        def init_module(self, module: nn.Module) -> None:
            reset_module(module)
            if isinstance(module, nn.Conv2d):  # torchvision's own initialisation of the convolutions
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    ResNet18.__qualname__ = "ResNet18"  # pickled by name, found again through the module's __getattr__
    return ResNet18


def __getattr__(name: str):
    if name == "ResNet18":
        return resnet18_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT-style decoder."""

    n_layer: int
    """Transformer blocks."""
    n_head: int
    """Attention heads per block."""
    d_model: int
    """Width of the residual stream."""
    vocab_size: int = 50304
    """Vocabulary (GPT-2's 50257 rounded up to a multiple of 64)."""
    seq_len: int = 1024
    """Longest sequence (learned position embeddings)."""
    dropout: float = 0.0
    """Dropout; 0 keeps ranks bit-for-bit comparable."""


GPT_PRESETS: dict[str, GPTConfig] = {
    "gpt-tiny": GPTConfig(n_layer=2, n_head=2, d_model=64, vocab_size=256, seq_len=64),
    # about 14M parameters: big enough that communication and optimizer state matter, small enough for a CPU
    "gpt-mini": GPTConfig(n_layer=6, n_head=6, d_model=384, vocab_size=8192, seq_len=256),
    # between the two, so a sweep on a small machine has three sizes at every world size
    "gpt-34m": GPTConfig(n_layer=8, n_head=8, d_model=512, vocab_size=16384, seq_len=256),
    "gpt-small": GPTConfig(n_layer=12, n_head=12, d_model=768),
    "gpt-medium": GPTConfig(n_layer=24, n_head=16, d_model=1024),
    "gpt-large": GPTConfig(n_layer=36, n_head=20, d_model=1280),
    "gpt-xl": GPTConfig(n_layer=48, n_head=25, d_model=1600),
    "gpt-2.7b": GPTConfig(n_layer=32, n_head=32, d_model=2560),
    "gpt-6.7b": GPTConfig(n_layer=32, n_head=32, d_model=4096),
    "gpt-13b": GPTConfig(n_layer=40, n_head=40, d_model=5120),
}


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(b, t, 3, self.n_head, c // self.n_head).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A GPT-2-style decoder: token and position embeddings, pre-norm blocks,
    a final LayerNorm and an output head tied to the token embedding."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        if not any(p.is_meta for p in self.parameters()):
            init_weights(self)

    def init_module(self, module: nn.Module) -> None:
        """GPT-2's: normal(0, 0.02) weights, zero biases, unit LayerNorms."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.LayerNorm):
            module.reset_parameters()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def shard_units(self) -> list[nn.Module]:
        return list(self.blocks)


def gpt_param_count(cfg: GPTConfig) -> int:
    """Parameters of :class:`GPT` from its shape alone (tied head counted once)."""
    d, L = cfg.d_model, cfg.n_layer
    per_block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    return cfg.vocab_size * d + cfg.seq_len * d + L * per_block + 2 * d


MODEL_NAMES = ["cnn", "resnet18", *GPT_PRESETS]


def model_input_kind(name: str) -> str:
    return "tokens" if name.startswith("gpt") else "image"


def build_model(
    name: str, in_channels: int = 1, num_classes: int = 10, image_size: int = 28, device: str | torch.device = "cpu"
) -> nn.Module:
    """Build a model by name; ``device="meta"`` makes one of any size without memory."""
    with torch.device(device):
        if name == "cnn":
            return MnistCNN(in_channels, num_classes, image_size)
        if name == "resnet18":
            return resnet18_class()(in_channels, num_classes)
        if name in GPT_PRESETS:
            return GPT(GPT_PRESETS[name])
    raise DistlabError(f"unknown model {name!r}: choose from {', '.join(MODEL_NAMES)}")


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (a tied weight counts once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


# float32 SGD over a few steps: only the order of additions differs between ranks and one process, which stays at
# rounding level. The tolerance at which two runs trained the same weights (the demos, the pages and the tests).
ATOL, RTOL = 1e-5, 1e-4


def relative_update_error(state: dict, reference: dict, initial: dict) -> float:
    """How far ``state`` lies from ``reference``, as a fraction of the update ``reference`` made from ``initial``.

    Three state dicts with ``reference``'s keys; each norm is over all their tensors together. After one SGD
    step from the same start the update is lr x gradient, so this is the relative error of the gradient that
    made ``state`` (low-precision parameters against fp32, in the FSDP2 chapter and its tests).
    """
    error = sum(((state[k] - reference[k]) ** 2).sum() for k in reference) ** 0.5
    update = sum(((reference[k] - initial[k]) ** 2).sum() for k in reference) ** 0.5
    return float(error / update)


class ToyWithFrozen(nn.Module):
    """Two linear layers whose first bias is frozen: a wrapper must neither reduce nor step what does not train
    (the DDP chapter's exercise and picture). No size divides by 2, 3 or 4."""

    def __init__(self, in_features: int = 11, hidden: int = 7, classes: int = 5):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(in_features, hidden), nn.Linear(hidden, classes)
        self.fc1.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))

    def shard_units(self) -> list[nn.Module]:
        return [self.fc1, self.fc2]

    def init_module(self, module: nn.Module) -> None:
        reset_module(module)


# From this many parameters up, a parameter-sharding strategy builds the model
# on the meta device and materialises only each rank's shards (--meta-init auto).
META_INIT_FROM_PARAMETERS = 50_000_000


def checkpoint_activations(model: nn.Module, name: str = "") -> None:
    """Recompute each shard unit's activations in backward instead of keeping them.

    Only a unit's input is saved in forward; backward runs the unit's forward
    again to rebuild the rest. The unit stays the same module (names, state
    dict and sharding unchanged): only its ``forward`` is routed through
    :func:`torch.utils.checkpoint.checkpoint`.
    """
    from functools import partial

    from torch.utils.checkpoint import checkpoint

    units = require_shard_units(model, "--activation-checkpointing")
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for unit in units for m in unit.modules()):
        raise DistlabError(
            f"--activation-checkpointing reruns each unit's forward in backward, which would update "
            f"{name or type(model).__name__}'s BatchNorm statistics twice: use it with the cnn or a GPT model"
        )
    for unit in units:
        # Non-reentrant: works with parameters that need no grad and with FSDP's hooks.
        unit.forward = partial(checkpoint, unit.forward, use_reentrant=False)
