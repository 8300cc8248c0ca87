"""A toy stage model for the schedule tests: residual tanh-MLP layers between a tied
input/output "embedding" (a learned per-feature scale), with an MSE loss.

Each layer's weights are drawn from a generator seeded with its global index, so a stage
holding layers 3-4 holds exactly layers 3-4 of the single-stage model, like GPTModel.
Activations are [s, b, h] as in the transformer; batches are batch-first.
"""
from __future__ import annotations

import torch

HIDDEN, SEQ, MICRO_BATCH = 8, 4, 2


class ToyLayer(torch.nn.Module):
    def __init__(self, index: int):
        super().__init__()
        generator = torch.Generator().manual_seed(1000 + index)
        self.weight = torch.nn.Parameter(torch.randn(HIDDEN, HIDDEN, generator=generator) / 3)
        self.bias = torch.nn.Parameter(torch.randn(HIDDEN, generator=generator) / 10)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # Ends in a residual add: the stage output is saved by no autograd node, as in a
        # transformer, so the pipeline may free it once sent.
        return hidden + torch.tanh(hidden @ self.weight.t() + self.bias)


class ToyStage(torch.nn.Module):
    """Layers [layer_offset, layer_offset + num_layers) of a `total_layers` model."""

    def __init__(self, total_layers: int, pre_process=True, post_process=True, layer_offset=0,
                 num_layers=None, tied=True, pipeline_size=1):
        super().__init__()
        num_layers = total_layers if num_layers is None else num_layers
        self.pre_process, self.post_process = pre_process, post_process
        self.tied = tied
        self.share_embeddings_and_output_weights = tied  # read by finalize_model_grads
        self.layers = torch.nn.ModuleList(
            ToyLayer(layer_offset + i) for i in range(num_layers)
        )
        generator = torch.Generator().manual_seed(7)
        scale = 1.0 + torch.randn(HIDDEN, generator=generator) / 5
        if pre_process:
            self.embed = torch.nn.Parameter(scale.clone())
        if post_process and not (pre_process and tied):
            generator = torch.Generator().manual_seed(7 if tied else 8)
            self.output = torch.nn.Parameter(1.0 + torch.randn(HIDDEN, generator=generator) / 5)
        if tied and pipeline_size > 1:
            if pre_process:
                self.embed.shared_embedding = True
            if post_process and not pre_process:
                self.output.shared_embedding = True
        self.input_tensor = None

    def shared_embedding_or_output_weight(self) -> torch.nn.Parameter:
        return self.embed if self.pre_process else self.output

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        hidden = x.transpose(0, 1) * self.embed if self.pre_process else self.input_tensor
        for layer in self.layers:
            hidden = layer(hidden)
        if not self.post_process:
            return hidden
        scale = self.output if hasattr(self, "output") else self.embed
        return ((hidden * scale).transpose(0, 1) - y).pow(2).mean(dim=-1)  # [b, s]


def microbatches(count: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return [
        {"x": torch.randn(MICRO_BATCH, SEQ, HIDDEN, generator=generator),
         "y": torch.randn(MICRO_BATCH, SEQ, HIDDEN, generator=generator)}
        for _ in range(count)
    ]


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["x"], batch["y"])

    def loss_func(output_tensor):
        loss = output_tensor.mean()
        return loss, {"loss": loss.detach()}

    return output, loss_func


def reference(total_layers: int, num_microbatches: int, tied=True):
    """Single-process losses and grads by global name (layer index, embed, output)."""
    model = ToyStage(total_layers, tied=tied)
    losses = []
    for batch in microbatches(num_microbatches):
        loss = model(batch["x"], batch["y"]).mean()
        losses.append(loss.item())
        (loss / num_microbatches).backward()
    return losses, named_grads(model, 0)


def named_grads(model: ToyStage, layer_offset: int) -> dict:
    grads = {}
    for i, layer in enumerate(model.layers):
        grads[f"layer{layer_offset + i}.weight"] = layer.weight.grad.clone()
        grads[f"layer{layer_offset + i}.bias"] = layer.bias.grad.clone()
    if hasattr(model, "embed"):
        grads["embed"] = model.embed.grad.clone()
    if hasattr(model, "output"):
        grads["output"] = model.output.grad.clone()
    return grads
