"""Loss scalers for fp16 training (Megatron's constant and dynamic scalers)."""
from __future__ import annotations

from typing import Optional

import torch


class ConstantGradScaler:
    """`--loss-scale S`: multiply the loss by S, never change it."""

    def __init__(self, scale: float, device: Optional[torch.device] = None):
        self._scale = torch.tensor([float(scale)], dtype=torch.float32, device=device)

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        # Scales are powers of two in practice, so the fp32 reciprocal is exact.
        return torch.reciprocal(self._scale)

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


class DynamicGradScaler(ConstantGradScaler):
    """Halve the scale after `hysteresis` overflowing steps, double it after
    `growth_interval` (--loss-scale-window) clean steps in a row, never below `min_scale`.

    The hysteresis counter is only refilled when the scale grows (as in Megatron), so
    isolated overflows spread over a window still add up.
    """

    def __init__(
        self,
        initial_scale: float = 2.0**32,
        min_scale: float = 1.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        device: Optional[torch.device] = None,
    ):
        super().__init__(initial_scale, device)
        if not (min_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1):
            raise ValueError(
                "need --min-loss-scale > 0, growth factor > 1 and 0 < backoff factor < 1"
            )
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.clamp(self._scale * self.backoff_factor, min=self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor

    def state_dict(self) -> dict:
        return {
            "scale": self._scale.item(),
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self._scale = torch.tensor(
            [float(state_dict["scale"])], dtype=torch.float32, device=self._scale.device
        )
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])
