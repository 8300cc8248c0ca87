"""Delayed parameter initialisation (SMP v2's `DelayedParamIniter`).

    model = GPTModel(config, state, device="meta")            # or smp.transform(meta_hf_model)
    initer = DelayedParamIniter(model)
    with initer.validate_params_and_buffers_inited():
        fully_shard_model(model, state, param_init_fn=initer.get_param_init_fn())

A model built on the meta device holds no memory. FSDP materialises it one unit at a time:
`param_init_fn(unit)` fills the unit's parameters on the device, then the unit is sharded and
its unsharded tensors are freed before the next unit is materialised. A rank therefore holds
its shards of the units done so far plus one unsharded unit, never the whole model.

The values equal the eager model's for the same seed. Our models draw every part under its
own CPU seed (`models.gpt`: the embedding under `derive_seed(base, 0)`, layer n under
`derive_seed(base, n)`, an untied output layer under `derive_seed(base, num_layers + 1)`,
multi-token-prediction layer k under `derive_seed(base, num_layers + 1 + k)`),
and a meta-built GPTModel draws the same `init_base_seed`. Materialising a part replays its
construction-time draws under its seed: each tensor-parallel layer's `reset_parameters`
(which redraws the full master on the CPU and keeps this rank's TP slice), in construction
order, and the learned position table the embedding draws after the word table.

Other models (a Hugging Face model wrapped directly) use `init_method_using_config(module)`,
called on every submodule that owns meta parameters, as in SMP: by default the model's own
`_init_weights` after `empty_module_params`.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterator, Optional

import torch

from megatron_smp.config import ConfigError


# SMP's torch.sagemaker.utils.module_utils helpers ----------------------------------------------


def _modules(module: torch.nn.Module, recurse: bool):
    return module.modules() if recurse else [module]


def empty_module_params(module: torch.nn.Module, device: Optional[torch.device] = None,
                        recurse: bool = False) -> torch.nn.Module:
    """Replace `module`'s meta parameters (all submodules' with `recurse`) by uninitialised
    ones of the same shape and dtype on `device` (default: the CPU). Attributes set on the
    parameters are kept; a parameter shared by two modules stays shared."""
    device = torch.device("cpu") if device is None else torch.device(device)
    replaced: Dict[int, torch.nn.Parameter] = {}
    for sub in _modules(module, recurse):
        for name, param in list(sub._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if id(param) not in replaced:
                new = torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype,
                                                     device=device),
                                         requires_grad=param.requires_grad)
                new.__dict__.update(param.__dict__)
                replaced[id(param)] = new
            sub._parameters[name] = replaced[id(param)]
    return module


def move_buffers_to_device(module: torch.nn.Module, device: torch.device,
                           recurse: bool = False) -> torch.nn.Module:
    """Move `module`'s buffers (all submodules' with `recurse`) to `device`. A buffer on the
    meta device has no value to move: a ConfigError naming it."""
    for sub in _modules(module, recurse):
        for name, buffer in list(sub._buffers.items()):
            if buffer is None:
                continue
            if buffer.is_meta:
                raise ConfigError(
                    f"buffer {name!r} of {type(sub).__name__} is on the meta device; build it "
                    "with a value (a computed table) or initialise it in init_method_using_config"
                )
            sub._buffers[name] = buffer.to(device)
    return module


def _has_meta_params(module: torch.nn.Module, recurse: bool = True) -> bool:
    return any(p.is_meta for p in module.parameters(recurse=recurse))


# Replaying our models' initialisation --------------------------------------------------------


def _replay_module(module: torch.nn.Module, device: torch.device) -> int:
    """Materialise and initialise `module`'s own meta params as its constructor did (the
    caller has seeded the generator). Returns the number of elements initialised.

    The model owns how: a module whose `reset_parameters()` draws what its constructor drew
    says so (`REPLAYS_CONSTRUCTOR_INIT = True`: the parallel linears and embedding, the
    norms); one that draws in several modules' order has `replay_init(replay, materialize)`
    (GPT's embedding)."""
    replay_init = getattr(module, "replay_init", None)
    if replay_init is not None:
        return replay_init(lambda part: _replay_module(part, device),
                           lambda part: empty_module_params(part, device))
    own = [p for p in module.parameters(recurse=False) if p.is_meta]
    if not own:
        return 0
    if not hasattr(module, "reset_parameters"):
        raise ConfigError(
            f"delayed initialisation: {type(module).__name__} has parameters on the meta "
            "device and no reset_parameters(); pass DelayedParamIniter(model, "
            "init_method_using_config=fn) that initialises it"
        )
    if not getattr(module, "REPLAYS_CONSTRUCTOR_INIT", False):
        # torch's own reset_parameters would draw other values than the constructor here.
        raise ConfigError(
            f"delayed initialisation does not know how {type(module).__name__} was "
            "initialised (a module without REPLAYS_CONSTRUCTOR_INIT or replay_init); build "
            "the model eagerly, or pass "
            "init_method_using_config=fn to DelayedParamIniter"
        )
    empty_module_params(module, device)
    module.reset_parameters()
    return sum(p.numel() for p in own)


def materialize_meta_model(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Materialise a model built on the meta device on `device`, in place, with the values
    the same model built eagerly has (seeded part by part, see the module docstring), and
    check that no parameter or buffer is left on meta. Returns `model`."""
    initer = DelayedParamIniter(model, device=device)
    with initer.validate_params_and_buffers_inited():
        initer.get_param_init_fn()(model)
        initer.get_post_param_init_fn()(model)
    return model


def language_model(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel under wrappers (`TransformedModel`, our DDP/FSDP wrapper)."""
    for module in model.modules():
        if hasattr(module, "decoder") and hasattr(module, "share_embeddings_and_output_weights"):
            return module
    raise ConfigError(
        f"{type(model).__name__} holds no megatron_smp GPTModel; wrap a GPTModel or a model "
        "returned by smp.transform (for another model pass its layers as layers=)"
    )


META_DEVICE_PROVIDER_ERROR = (
    "--init-model-with-meta-device builds the model on the meta device, but the model "
    "provider takes no device= argument: forward device= to the model (pretrain_gpt.py's "
    "model_provider does, through **stage), or drop the flag"
)


def provider_accepts_device(model_provider: Callable) -> bool:
    """Whether `model_provider` takes `device=` (and can therefore build on the meta device)."""
    import inspect

    try:
        parameters = inspect.signature(model_provider).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "device" or p.kind is p.VAR_KEYWORD for p in parameters)


class DelayedParamIniter:
    """SMP v2's delayed parameter initialiser for a model built on the meta device.

    * `get_param_init_fn()` -> fn(module): materialise `module`'s meta parameters on the
      device with their initial values (pass it as `param_init_fn` to `fully_shard_model`).
    * `get_post_param_init_fn()` -> fn(module): re-ties shared weights (`module.tie_weights()`
      where the model has it) after materialisation.
    * `count_num_params(module, *params)`: adds to the count of initialised elements.
    * `validate_params_and_buffers_inited(enabled=True)`: a context; on exit, raises
      AssertionError unless every parameter element was initialised once and no parameter or
      buffer is left on the meta device.

    `init_method_using_config(module)`: for models other than ours, called on each submodule
    owning meta parameters (it must materialise them, e.g. with `empty_module_params`).
    """

    def __init__(self, model: torch.nn.Module,
                 init_method_using_config: Optional[Callable[[torch.nn.Module], None]] = None,
                 verbose: bool = False, device: Optional[torch.device] = None) -> None:
        self.model = model
        self.verbose = verbose
        self.num_params_inited = 0
        self.init_method_using_config = init_method_using_config
        self._seeds: Dict[int, Optional[int]] = {}
        self._gpt = None
        if init_method_using_config is None:
            try:
                self._gpt = language_model(model)
            except ConfigError:
                self.init_method_using_config = self._hf_init_method(model)
            else:
                self._seeds = {id(part): seed for part, seed in self._gpt.init_seed_parts()}
        if device is None:
            state = getattr(self._gpt, "state", None)
            device = state.device if state is not None else torch.device("cpu")
        self.device = torch.device(device)

    @staticmethod
    def _hf_init_method(model: torch.nn.Module) -> Callable[[torch.nn.Module], None]:
        init_weights = getattr(model, "_init_weights", None)
        if init_weights is None:
            raise ConfigError(
                f"DelayedParamIniter: {type(model).__name__} is neither a megatron_smp model "
                "nor a Hugging Face PreTrainedModel; pass init_method_using_config=fn"
            )

        def init(module: torch.nn.Module) -> None:
            empty_module_params(module)
            with torch.no_grad():
                init_weights(module)

        return init

    def _log(self, message: str) -> None:
        if self.verbose:
            print(f"[DelayedParamIniter] {message}", flush=True)

    def count_num_params(self, module: torch.nn.Module, *params: torch.nn.Parameter) -> None:
        """Add the elements of `params` (default: `module`'s own parameters)."""
        params = params or tuple(module.parameters(recurse=False))
        self.num_params_inited += sum(p.numel() for p in params)

    def _init_gpt_unit(self, unit: torch.nn.Module) -> None:
        from megatron_smp.transformer.utils import init_rng_scope

        done = set()
        for module in unit.modules():
            if id(module) in done or id(module) not in self._seeds:
                continue
            with init_rng_scope(self._seeds[id(module)]):
                for sub in module.modules():
                    if id(sub) not in done:
                        self.num_params_inited += _replay_module(sub, self.device)
                    done.add(id(sub))
                    if type(sub).__name__ == "LanguageModelEmbedding":
                        done.update(id(m) for m in sub.modules())
            self._log(f"initialised {type(module).__name__} (seeded part)")
        # Parameters outside the seeded parts (final norm): deterministic, no draw.
        for module in unit.modules():
            if id(module) not in done:
                self.num_params_inited += _replay_module(module, self.device)
        move_buffers_to_device(unit, self.device, recurse=True)

    def get_param_init_fn(self) -> Callable[[torch.nn.Module], None]:
        def param_init_fn(module: torch.nn.Module) -> None:
            if self._gpt is not None:
                self._init_gpt_unit(module)
                return
            for sub in module.modules():
                own = [p for p in sub.parameters(recurse=False) if p.is_meta]
                if own:
                    self.init_method_using_config(sub)
                    still = [p for p in sub.parameters(recurse=False) if p.is_meta]
                    if still:
                        raise ConfigError(
                            f"init_method_using_config left {len(still)} parameter(s) of "
                            f"{type(sub).__name__} on the meta device; call "
                            "empty_module_params(module, device) in it"
                        )
                    self.count_num_params(sub, *own)
            move_buffers_to_device(module, self.device, recurse=True)

        return param_init_fn

    def get_post_param_init_fn(self) -> Callable[[torch.nn.Module], None]:
        def post_param_init_fn(module: torch.nn.Module) -> None:
            tie_weights = getattr(module, "tie_weights", None)
            if callable(tie_weights):
                tie_weights()

        return post_param_init_fn

    @contextlib.contextmanager
    def validate_params_and_buffers_inited(self, enabled: bool = True) -> Iterator[None]:
        seen, total = set(), 0
        for param in self.model.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                total += param.numel()
        start = self.num_params_inited
        yield
        if not enabled:
            return
        inited = self.num_params_inited - start
        assert inited == total, (
            f"DelayedParamIniter: {inited} parameter elements initialised, the model has {total}"
        )
        left = [name for name, t in list(self.model.named_parameters())
                + list(self.model.named_buffers()) if t.is_meta]
        assert not left, f"DelayedParamIniter: still on the meta device: {left[:5]}"
        self._log(f"validated: {total} parameter elements initialised")


__all__ = ["DelayedParamIniter", "empty_module_params", "move_buffers_to_device"]
