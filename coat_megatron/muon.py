"""Megatron-core's own Muon (`--optimizer muon`) with its momentum in FP8: `CoatTensorParallelMuon`.

Megatron builds Muon as its `TensorParallelMuon` (a subclass of emerging_optimizers' OrthogonalizedOptimizer) inside
a Float16OptimizerWithFloat16Params / FP32Optimizer wrapper, chained with Adam for the parameters Muon does not take
(embeddings, output layer, norms, biases); under `LayerWiseDistributedOptimizer` every data-parallel rank steps whole
parameters. Its state is one `momentum_buffer` per (whole, or tensor-parallel shard of a) matrix, in the parameter's
dtype. `CoatTensorParallelMuon` is that optimizer with the momentum stored as COAT stores CoatFP8AdamW's first moment
(a coat_kernels.optim state entry: FP8 codes and per-group Dynamic Range Expansion metadata, `exp_avg_q` /
`exp_avg_meta`, about 1.1 bytes per element at group size 128 instead of 4).

A step runs Megatron's own step (weight decay, momentum, Nesterov, `orthogonalize`: Newton-Schulz, tensor-parallel
gathers, QKV split and scaling, the update) unchanged, over batches of matrices whose momenta are dequantized into a
`momentum_buffer` for the step and quantized back after it (coat_kernels.optim.moment_batch: one call each way per
batch of at most 2^24 elements, which bounds the transient fp32 momenta). The matrices keep Megatron's order, so
tensor-parallel ranks meet in the same collectives. The parameter gets exactly what Megatron's step gives it; a
momentum that comes out NaN/Inf (a non-finite gradient) is not stored: the matrix keeps its previous FP8 momentum,
and `skipped_matrices` counts it.

Checkpoints hold Megatron's Muon layout: `state_dict()` gives every matrix its fp32 `momentum_buffer` shaped like the
parameter (exported so that it quantizes back to the same codes and metadata, coat_kernels.optim.exact_export), no
step (Megatron's Muon counts none; the entries' `step` restarts at 0 on load), and `load_state_dict` quantizes the
`momentum_buffer`s it is given: checkpoints interchange with Megatron's own Muon both ways.

`state_dtype="fp32"` is the reference arm: Megatron's own `momentum_buffer` in the parameter's dtype, stepped through
the same batches; its steps and state dicts are Megatron's.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict

import torch

from coat_kernels.optim import moment_batch, state as coat_state
from coat_kernels.optim.backends import use_triton
from coat_kernels.optim.config import DEFAULTS, OptimizerConfig
from coat_kernels.optim.grouping import GroupLayout, build_layout
from coat_kernels.optim.validation import StateError

MEGATRON_BUFFER = "momentum_buffer"  # Megatron's (emerging_optimizers') name of the Muon momentum
STATE_DTYPES = ("fp8", "fp32")


def _megatron_tensor_parallel_muon():
    """Megatron's TensorParallelMuon: megatron.core.optimizer.emerging_optimizers from 0.18 on, .muon before."""
    try:
        from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon
    except ImportError:
        from megatron.core.optimizer.muon import TensorParallelMuon
    return TensorParallelMuon


TensorParallelMuon = _megatron_tensor_parallel_muon()


def have_megatron_muon() -> bool:
    """Whether Megatron's Muon can be built here: without NVIDIA's emerging_optimizers package megatron-core
    defines TensorParallelMuon on `object`."""
    return issubclass(TensorParallelMuon, torch.optim.Optimizer)


def _megatron_step():
    """Megatron's step function itself. torch wraps the step of every optimizer class it instantiates with its hook
    runner (step pre/post hooks, profiler); CoatTensorParallelMuon's own step runs the hooks once per step, so the
    batches call the unwrapped function."""
    step = TensorParallelMuon.step
    while getattr(step, "hooked", False):
        step = step.__wrapped__
    return step


class CoatTensorParallelMuon(TensorParallelMuon):
    """Megatron's TensorParallelMuon with the momentum in FP8 (see the module docstring).

    Build it with TensorParallelMuon's arguments (`coat_config`: the COAT options, an OptimizerConfig; its exp_avg_*
    options and group_size apply to the momentum), or from the optimizer Megatron built with `adopt`.
    """

    def __init__(self, params, *, coat_config: OptimizerConfig | None = None, state_dtype: str = "fp8",
                 **tensor_parallel_muon_options):
        _require_megatron_muon()
        super().__init__(params, **tensor_parallel_muon_options)
        self._use_store(coat_config, state_dtype)

    @classmethod
    def adopt(cls, megatron_muon, coat_config: OptimizerConfig | None = None,
              state_dtype: str = "fp8") -> "CoatTensorParallelMuon":
        """The optimizer Megatron built (its param groups, Newton-Schulz and scaling function, tensor-parallel and QKV
        settings: all its attributes), as this class: unpickled into it, as torch restores an optimizer. Megatron's
        momenta, where it has any, are carried over (quantized)."""
        _require_megatron_muon()
        if type(megatron_muon) is not TensorParallelMuon:
            raise TypeError(f"CoatTensorParallelMuon.adopt takes Megatron's TensorParallelMuon, got "
                            f"{type(megatron_muon).__name__}")
        coat = cls.__new__(cls)
        coat.__setstate__({**vars(megatron_muon), "state": defaultdict(dict)})
        coat._use_store(coat_config, state_dtype)
        for p, entry in megatron_muon.state.items():
            if MEGATRON_BUFFER in entry:
                coat.set_fp32_momentum(p, entry[MEGATRON_BUFFER])
        return coat

    def _use_store(self, coat_config, state_dtype):
        coat_config = DEFAULTS if coat_config is None else coat_config
        if not isinstance(coat_config, OptimizerConfig):
            raise TypeError(f"CoatTensorParallelMuon: coat_config must be an OptimizerConfig, got "
                            f"{type(coat_config).__name__}")
        if coat_config.master_remainders:
            raise ValueError("CoatTensorParallelMuon does not support master_remainders (CoatFP8AdamW's option)")
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"CoatTensorParallelMuon: state_dtype must be one of {STATE_DTYPES}, got {state_dtype!r}")
        self.coat_config, self.state_dtype = coat_config, state_dtype
        self._momentum_config = coat_config.moment_configs()[0]
        self._layouts: dict[torch.Tensor, GroupLayout] = {}
        self._moment_batches: dict[tuple, moment_batch.MomentBatch] = {}
        self._skipped: dict[torch.device, torch.Tensor] = {}
        self.initialize_state()

    # ---- the state -----------------------------------------------------------------------------------------------
    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def initialize_state(self) -> None:
        """A zero momentum for every matrix without one (what Megatron's init_state_fn makes before a checkpoint
        load, and its first step)."""
        for p in self._params():
            if not self.state[p]:
                self.state[p] = self._zero_entry(p)

    def _zero_entry(self, p: torch.Tensor) -> dict:
        if self.state_dtype == "fp32":
            return {MEGATRON_BUFFER: torch.zeros_like(p)}
        layout = self._layout(p)
        return coat_state.zero_entry(p.numel(), torch.tensor([[0, p.numel(), 0]], dtype=torch.int64), layout,
                                     {"exp_avg": self._momentum_config}, p.device)

    def _layout(self, p: torch.Tensor) -> GroupLayout:
        layout = self._layouts.get(p)
        if layout is None:
            layout = self._layouts[p] = build_layout(None, p.numel(), self.coat_config.group_size)
        return layout

    def fp32_momentum(self, p: torch.Tensor) -> torch.Tensor:
        """p's momentum in fp32, shaped like p; from the FP8 state, values that quantize back to its codes and
        metadata."""
        entry = self.state[p]
        if self.state_dtype == "fp32":
            return entry[MEGATRON_BUFFER].float().clone()
        return coat_state.to_fp32(entry, self._momentum_config)["exp_avg"].view(p.shape)

    def set_fp32_momentum(self, p: torch.Tensor, momentum: torch.Tensor) -> None:
        """Replace p's momentum by these values (p's numel, any shape; finite), quantized now."""
        if momentum.numel() != p.numel():
            raise StateError(f"{self._describe(p)}: a momentum of {momentum.numel()} elements for a matrix of "
                             f"{p.numel()}")
        if self.state_dtype == "fp32":
            self.state[p] = {MEGATRON_BUFFER: momentum.detach().reshape(p.shape).to(p.dtype, copy=True)}
            return
        try:
            codes, meta = coat_state.quantize_moment(momentum.to(p.device), self._layout(p), self._momentum_config,
                                                     use_triton(self.coat_config.backend, p,
                                                                self.coat_config.group_size))
        except ValueError as exc:
            raise StateError(f"{self._describe(p)}: {exc}") from None
        entry = self._zero_entry(p)
        entry.update(exp_avg_q=codes, exp_avg_meta=meta)
        self.state[p] = entry

    def state_bytes(self) -> int:
        return sum(coat_state.entry_bytes(entry) for entry in self.state.values())

    @property
    def skipped_matrices(self) -> int:
        """Matrices whose new momentum was NaN/Inf and so kept their previous one (synchronizes)."""
        return int(sum(int(count) for count in self._skipped.values()))

    def _describe(self, p: torch.Tensor) -> str:
        return f"CoatTensorParallelMuon matrix of shape {tuple(p.shape)}"

    # ---- the step ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.initialize_state()
        params = [p for p in self._params() if p.grad is not None]
        layouts = [self._layout(p) for p in params]
        for batch in moment_batch.batches(layouts):
            self._step_batch([params[i] for i in batch])
        return loss

    def _step_batch(self, params: list[torch.Tensor]) -> None:
        """Megatron's step of these matrices, their momenta in a momentum_buffer each for its duration."""
        if self.state_dtype == "fp32":
            with self._stepping_only(params):
                _megatron_step()(self)
            return
        batch = self._moment_batch(params)
        entries = [self.state[p] for p in params]
        momenta = batch.dequantize([e["exp_avg_q"] for e in entries], [e["exp_avg_meta"] for e in entries])
        for p, entry, m in zip(params, entries, momenta):
            entry[MEGATRON_BUFFER] = m.view(p.shape).to(p.dtype)
        try:
            with self._stepping_only(params):
                _megatron_step()(self)
            new_momenta = [entry[MEGATRON_BUFFER] for entry in entries]
        finally:
            for entry in entries:
                entry.pop(MEGATRON_BUFFER, None)
        finite = [torch.isfinite(m).all() for m in new_momenta]
        codes, metas = batch.quantize([m.float() for m in new_momenta], self._momentum_config)
        for entry, ok, new_codes, new_meta in zip(entries, finite, codes, metas):
            stored = entry["exp_avg_q"].view(torch.uint8)
            torch.where(ok, new_codes.view(torch.uint8), stored, out=stored)
            torch.where(ok, new_meta, entry["exp_avg_meta"], out=entry["exp_avg_meta"])
            entry["step"] += 1
        device = params[0].device
        skipped = (~torch.stack(finite)).sum(dtype=torch.int64)
        self._skipped[device] = self._skipped.get(device, 0) + skipped

    def _moment_batch(self, params: list[torch.Tensor]) -> moment_batch.MomentBatch:
        """The (de)quantization of these matrices' momenta in one call each way, kept per list of matrices."""
        key = tuple(id(p) for p in params)
        batch = self._moment_batches.get(key)
        if batch is None:
            cfg = self.coat_config
            triton = use_triton(cfg.backend, params[0], cfg.group_size)
            batch = self._moment_batches[key] = moment_batch.MomentBatch([self._layout(p) for p in params],
                                                                         params[0].device, triton)
        return batch

    @contextlib.contextmanager
    def _stepping_only(self, params: list[torch.Tensor]):
        """Megatron's step sees only `params` (in its own order) while this lasts; the param groups are restored
        after it, whatever happens."""
        chosen = {id(p) for p in params}
        groups = self.param_groups
        self.param_groups = [{**g, "params": [p for p in g["params"] if id(p) in chosen]} for g in groups]
        try:
            yield
        finally:
            self.param_groups = groups

    # ---- checkpoints: Megatron's Muon layout ---------------------------------------------------------------------
    def state_dict(self):
        """torch's state dict in Megatron's Muon layout: per matrix its fp32 `momentum_buffer` shaped like it."""
        state_dict = super().state_dict()
        if self.state_dtype == "fp8":
            index = {id(p): i for i, p in enumerate(self._params())}
            state_dict["state"] = {index[id(p)]: {MEGATRON_BUFFER: self.fp32_momentum(p)}
                                   for p, entry in self.state.items() if id(p) in index and entry}
        return state_dict

    def load_state_dict(self, state_dict):
        """Megatron's Muon state dict (`momentum_buffer` per matrix, from this optimizer or Megatron's own): checked
        first (a bad entry raises StateError naming the matrix, the optimizer unchanged), then loaded as torch loads
        it, the momenta quantized."""
        params = self._params()
        for index, entry in state_dict["state"].items():
            where = f"CoatTensorParallelMuon: state entry {index!r} of the loaded state dict"
            if not isinstance(index, int) or not 0 <= index < len(params):
                raise StateError(f"{where} names no matrix of this optimizer ({len(params)} matrices)")
            extra = set(entry) - {MEGATRON_BUFFER, "step"}
            if extra:
                raise StateError(f"{where} holds {sorted(extra)}; Megatron's Muon state is {MEGATRON_BUFFER!r} "
                                 "(and, from other runs, 'step')")
            momentum = entry.get(MEGATRON_BUFFER)
            if momentum is not None and (not isinstance(momentum, torch.Tensor)
                                         or momentum.numel() != params[index].numel()
                                         or not torch.isfinite(momentum).all()):
                raise StateError(f"{where}: {MEGATRON_BUFFER} must be a finite tensor of the matrix's "
                                 f"{params[index].numel()} elements, got {_described(momentum)}")
        super().load_state_dict(state_dict)
        self._moment_batches = {}
        for p in params:
            momentum = self.state[p].get(MEGATRON_BUFFER)
            if momentum is None:
                self.state[p] = self._zero_entry(p)
            else:
                self.set_fp32_momentum(p, momentum)


def _described(value) -> str:
    if isinstance(value, torch.Tensor):
        finite = "finite" if torch.isfinite(value).all() else "holding NaN/Inf"
        return f"a {value.dtype} tensor of {value.numel()} elements, {finite}"
    return type(value).__name__


def _require_megatron_muon() -> None:
    if not have_megatron_muon():
        raise ImportError("Megatron's Muon needs NVIDIA's emerging_optimizers package (megatron-core 0.16/0.17: "
                          "v0.1.0, 0.18/0.19: v0.2.0), which megatron-core installs from github.com/NVIDIA-NeMo/"
                          "Emerging-Optimizers")
