"""The ledger of what coat_ds changes in DeepSpeed (and torch.optim) and which DeepSpeed internals it reads.

PATCHES: every attribute coat_ds replaces, extends or wraps. The code applies each patch through this module
(`set_value`, `append_member`, `wrap`, `wrap_instance`), always naming its PatchSite, so a patch exists only where the
ledger has an entry. The one exception is the start-up import hook (coat_ds._autoregister runs before coat_ds can be
imported); its entry is here all the same. INTERNALS: the non-public DeepSpeed attributes and layouts coat_ds reads
(or, for ZeRO-3's `ds_id` and the master-partition lists, writes) without patching them.

Each entry says what it needs from DeepSpeed, why coat_ds needs it and which tests pin it: a DeepSpeed upgrade that
renames or changes one of them fails those tests. tests/deepspeed/test_patch_sites.py keeps the ledger and the code in
step: it fails for a patch applied elsewhere than here, for a private DeepSpeed attribute read but not listed, for an
entry no code uses any more, and for a pinning test that does not exist; and after `register_with_deepspeed()` it
checks that every class- and module-level patch is in place.
Built and tested against DeepSpeed 0.19.8.
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Callable

from .optimizer import OPTIMIZER_NAME

# The tests that pin the entries ("file::test")
ZERO_STAGES = "tests/deepspeed/test_deepspeed.py::test_zero_stages_match_single_process"
CHECKPOINTS = "tests/deepspeed/test_deepspeed.py::test_checkpoints_nonfinite_and_resharding"
REMAINDERS = ("tests/deepspeed/test_deepspeed_remainders.py::"
              "test_remainders_train_like_fp32_masters_and_checkpoint_exactly")
REGISTRATION = ("tests/deepspeed/test_deepspeed_registration.py::"
                "test_import_deepspeed_registers_without_importing_coat_ds")
PROBES = "tests/deepspeed/test_deepspeed_registration.py::test_probes_before_the_import_do_not_consume_the_hook"
MISSPELT_TYPE = ("tests/deepspeed/test_deepspeed_registration.py::"
                 "test_misspelled_type_fails_deepspeed_initialize_with_the_hint")
MISSPELT_SECTION = ("tests/deepspeed/test_ds_config_section.py::"
                    "test_misspelt_section_fails_deepspeed_initialize_with_the_hint")
HF_SECTION = "tests/hf/test_hf.py::test_deepspeed_zero2_and_zero3_from_the_ds_config_alone"
OFFLOAD = "tests/kernels/optim/test_cpu_step.py::test_deepspeed_zero2_cpu_offload_resumes_bit_exactly"
IN_PLACE = "tests/deepspeed/test_patch_sites.py::test_every_class_and_module_patch_is_in_place_after_registration"
GRAPH_POOL_STEP = "tests/gpu/test_graph_pool_loans_gpu.py::test_zero2_steps_borrow_the_graph_pool_with_the_same_bits"


@dataclass(frozen=True)
class PatchSite:
    owners: tuple[str, ...]  # "module" or "module:Class" whose attribute changes (or whose instances' attribute)
    attribute: str
    change: str  # "set", "appended to", "wrapped", "wrapped on the instance"
    needs: str  # what DeepSpeed does that makes this patch work
    why: str
    applied_in: str
    pinned_by: tuple[str, ...]


@dataclass(frozen=True)
class Internal:
    names: tuple[str, ...]  # attributes, methods, keys or functions as the code spells them
    of: str  # whose they are
    why: str
    used_in: tuple[str, ...]
    pinned_by: tuple[str, ...]


ENGINE = "deepspeed.runtime.engine:DeepSpeedEngine"
ZERO_1_2 = "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer"
ZERO_3 = "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3"
STATE_MODULES = ("deepspeed.utils.tensor_fragment", "deepspeed.utils")  # the functions' home, and their export

TORCH_OPTIM_CLASS = PatchSite(
    ("torch.optim",), OPTIMIZER_NAME, "set",
    "DeepSpeed builds an optimizer `type` it does not know as getattr(torch.optim, type)(params, **params)",
    'the ds_config\'s "optimizer": {"type": "CoatFP8AdamW"} (DeepSpeed has no optimizer registry)',
    "coat_ds.deepspeed_plugin", (REGISTRATION, ZERO_STAGES, IN_PLACE))
LION_MUON = "tests/deepspeed/test_deepspeed_lion_muon.py::test_lion_and_muon_from_the_ds_config"
MUON_ZERO = LION_MUON  # its job runs CoatFP8Muon on ZeRO-1/2 too (tests/jobs/ds_muon_zero_job.py)
TORCH_OPTIM_LION, TORCH_OPTIM_MUON = (
    PatchSite(("torch.optim",), name, "set", TORCH_OPTIM_CLASS.needs,
              f'the ds_config\'s "optimizer": {{"type": "{name}"}}', "coat_ds.deepspeed_plugin", (LION_MUON, IN_PLACE))
    for name in ("CoatFP8Lion", "CoatFP8Muon"))
ZERO_SUPPORTED = PatchSite(
    ("deepspeed.runtime.zero.utils",), "ZERO_SUPPORTED_OPTIMIZERS", "appended to",
    "ZeRO accepts the optimizers of this list without zero_allow_untested_optimizer",
    "ZeRO-1/2/3 take CoatFP8AdamW as a tested optimizer", "coat_ds.deepspeed_plugin",
    (REGISTRATION, ZERO_STAGES, IN_PLACE))
SANITY_CHECK = PatchSite(
    (ENGINE,), "_do_optimizer_sanity_check", "wrapped",
    "the engine calls it with the basic optimizer before it builds the ZeRO / bf16 wrapper around it",
    "refuse the modes that cannot hold FP8 states (elastic checkpoints, NVMe swap) and master remainders without "
    "bf16 masters, before anything is built", "coat_ds.deepspeed_plugin", (CHECKPOINTS, REMAINDERS, IN_PLACE))
CONFIGURE_ZERO = PatchSite(
    (ENGINE,), "_configure_zero_optimizer", "wrapped",
    "it builds and returns the ZeRO optimizer around the basic optimizer",
    "with master remainders: the ZeRO optimizer steps the model's bf16 partitions and loads universal checkpoints "
    "exactly (coat_ds.master_partitions)", "coat_ds.deepspeed_plugin", (REMAINDERS, IN_PLACE))
ENGINE_INIT = PatchSite(
    (ENGINE,), "__init__", "wrapped",
    "every engine (deepspeed.initialize, accelerate, the HF Trainer, subclasses through super()) runs it, with the "
    "keyword `config_class` (its `optimizer_name`, `zero_optimization_stage`, `gradient_accumulation_steps`), "
    "`config` (the ds_config dict) and `model` (or the second positional argument)",
    'a misspelt optimizer type named; the "coat" section applied before DeepSpeed wraps the model; after the build, '
    "parameters linked to a ZeRO-1/2 CoatFP8AdamW, the runtime's clock attached, ZeRO-3 external parameters",
    "coat_ds.engine_hooks", (MISSPELT_TYPE, MISSPELT_SECTION, HF_SECTION, ZERO_STAGES, IN_PLACE))
GET_FULL_STATE, SET_FULL_STATE, GET_LOCAL_STATE, SET_LOCAL_STATE = (
    PatchSite(STATE_MODULES, name, "wrapped",
              "DeepSpeed's per-parameter optimizer-state functions look for fp32 state tensors of the partition's "
              "shape; its callers resolve them through these two modules",
              "answer in fp32 moments for CoatFP8AdamW's FP8 states (coat_ds.full_optimizer_state); other "
              "optimizers get DeepSpeed's answers", "coat_ds.full_optimizer_state", (ZERO_STAGES, OFFLOAD, IN_PLACE))
    for name in ("safe_get_full_optimizer_state", "safe_set_full_optimizer_state",
                 "safe_get_local_optimizer_state", "safe_set_local_optimizer_state"))
MASTER_STATE_DICT = PatchSite(
    (ZERO_1_2, ZERO_3), "state_dict", "wrapped on the instance",
    "its master partitions are saved under single_partition_of_fp32_groups / fp32_flat_groups",
    "with master remainders the masters are views of the bf16 flat buffers, which would be saved whole: save copies",
    "coat_ds.master_partitions", (REMAINDERS,))
UNIVERSAL_LOAD_1_2 = PatchSite(
    (ZERO_1_2,), "load_hp_checkpoint_state_from_checkpoint_dir", "wrapped on the instance",
    "it loads a universal checkpoint's fp32 weights and moments into tensors of the master partitions' dtype",
    "with bf16 masters: load into fp32 stand-ins, then hand CoatFP8AdamW exact masters and moments",
    "coat_ds.master_partitions", (REMAINDERS,))
UNIVERSAL_LOAD_3 = PatchSite(
    (ZERO_3,), "load_hp_checkpoint_state_from_checkpoint_dir_stage3", "wrapped on the instance",
    "as for ZeRO-1/2, over fp32_partitioned_groups_flat", "as for ZeRO-1/2", "coat_ds.master_partitions",
    (REMAINDERS,))
ZERO_STEP = PatchSite(
    (ZERO_1_2,), "step", "wrapped on the instance",
    "the engine steps the ZeRO-1/2 optimizer through it once per accumulation boundary, after the backward",
    "with per-layer CUDA graphs: the step borrows the graphs' pool memory (coat_ds.graph_pool_step)",
    "coat_ds.graph_pool_step", (GRAPH_POOL_STEP,))
ZERO_FLATTEN = PatchSite(
    (ZERO_1_2,), "flatten", "wrapped on the instance",
    "step() makes each gradient partition with self.flatten (also inside flatten_dense_tensors_aligned), then "
    "converts it with .to(master dtype), which returns a tensor already of that dtype as it is",
    "during a step that borrows the graphs' pool: one master-dtype copy in the pool's memory instead of two new "
    "tensors", "coat_ds.graph_pool_step", (GRAPH_POOL_STEP,))
MUON_MOMENTUM_BUFFER = PatchSite(
    (ZERO_1_2,), "_muon_momentum_buffer", "wrapped on the instance",
    "get_flat_partition calls it (tensor_list = the partition's parameters, in order) before staging the momentum of "
    "a Muon group, for its side effect: the optimizer state's momentum_buffer over those whole parameters",
    "CoatFP8Muon under ZeRO-1/2: the momentum is CoatFP8Muon's entry of the flat partition (FP8 codes and metadata, "
    "or state_dtype) instead of DeepSpeed's buffer in the gradient's dtype", "coat_ds.muon_zero", (MUON_ZERO,))
MUON_STAGING = PatchSite(
    (ZERO_1_2,), "_muon_staging_momentum", "wrapped on the instance",
    "it returns the flat momentum (the partition's whole parameters, in order) that muon_update updates in place "
    "while the gradient partition is cut; DeepSpeed keeps it between steps",
    "a transient copy of CoatFP8Muon's momentum in the gradient's dtype, freed at the commit",
    "coat_ds.muon_zero", (MUON_ZERO,))
MUON_COMMIT = PatchSite(
    (ZERO_1_2,), "_commit_muon_momentum", "wrapped on the instance",
    "step() calls it once it knows the step survived (no overflow), before the optimizer steps",
    "store the staged momentum in CoatFP8Muon's state (quantized) and free it", "coat_ds.muon_zero", (MUON_ZERO,))
AVERAGE_TENSOR = PatchSite(
    (ZERO_1_2,), "average_tensor", "wrapped on the instance",
    "it reduces an IPG bucket and all-reduces a Muon matrix cut by a partition edge to every rank holding a piece "
    "of it when isinstance(self.optimizer, MuonWithAuxAdam), its only use of self.optimizer",
    "CoatFP8Muon's cut matrices get DeepSpeed's whole-gradient copies: during the call self.optimizer is an object "
    "that is a MuonWithAuxAdam for isinstance and raises for anything else", "coat_ds.muon_zero", (MUON_ZERO,))
IMPORT_HOOK = PatchSite(
    ("importlib.machinery:SourceFileLoader",), "exec_module", "wrapped on the instance",
    "the loader of the spec found for `deepspeed`: its exec_module runs deepspeed's code",
    "register CoatFP8AdamW right after deepspeed is executed, in scripts that never import coat_ds (applied by "
    "coat_ds._autoregister itself, which runs at interpreter start-up)", "coat_ds._autoregister", (PROBES,))

PATCHES = (TORCH_OPTIM_CLASS, TORCH_OPTIM_LION, TORCH_OPTIM_MUON, ZERO_SUPPORTED, SANITY_CHECK, CONFIGURE_ZERO,
           ENGINE_INIT, GET_FULL_STATE, SET_FULL_STATE, GET_LOCAL_STATE, SET_LOCAL_STATE, MASTER_STATE_DICT,
           UNIVERSAL_LOAD_1_2, UNIVERSAL_LOAD_3, ZERO_STEP, ZERO_FLATTEN, MUON_MOMENTUM_BUFFER, MUON_STAGING,
           MUON_COMMIT, AVERAGE_TENSOR, IMPORT_HOOK)

INTERNALS = (
    Internal(("_hp_mapping", "hp_fragment", "get_hp_fragment_address", "lp_fragment_address", "param_group_index",
              "get_hp_fragment"), "a ZeRO-1/2 or BF16_Optimizer low-precision parameter (its tensor_fragment)",
             "which run of the flat fp32 partition belongs to which parameter, at which offset (and, for CoatFP8Muon, "
             "which whole matrices a Muon partition's momentum covers)",
             ("coat_ds.zero_segments", "coat_ds.full_optimizer_state", "coat_ds.muon_momentum_entry"),
             (ZERO_STAGES, MUON_ZERO)),
    Internal(("ds_id", "partition_numel", "ds_numel", "ds_process_group", "ds_tensor"),
             'a ZeRO-3 parameter; a flat fp32 sub-group is named ds_id "<first ds_id>_<last ds_id>"',
             "each parameter's shard inside a flat sub-group; coat_ds.master_partitions gives the tensors it swaps in "
             "the sub-group's ds_id", ("coat_ds.zero_segments", "coat_ds.full_optimizer_state",
                                       "coat_ds.master_partitions"), (ZERO_STAGES, REMAINDERS)),
    Internal(("_zero_optimizer", "_dp_group", "_create_optimizer_mapping"),
             "a ZeRO-1/2 parameter, linked to its DeepSpeedZeroOptimizer by _create_optimizer_mapping",
             "the per-parameter optimizer-state functions find the FP8 states through the link, which DeepSpeed "
             "makes only with CPU offload (coat_ds.engine_hooks makes it for every ZeRO-1/2 CoatFP8AdamW)",
             ("coat_ds.full_optimizer_state", "coat_ds.engine_hooks"), (ZERO_STAGES, OFFLOAD)),
    Internal(("_z3_optimizer", "grad_position", "get_param_id", "_fp32_state_allgather", "_get_param_partition_rank",
              "reduce_and_partition_stream"), "ZeRO-3 parameters and DeepSpeedZeroOptimizer_Stage3",
             "a parameter's partition inside its flat sub-group, and DeepSpeed's gather of a full state",
             ("coat_ds.full_optimizer_state",), (ZERO_STAGES,)),
    Internal(("single_partition_of_fp32_groups", "parallel_partitioned_bit16_groups", "real_dp_process_group",
              "_link_all_hp_params"), "DeepSpeedZeroOptimizer",
             "its master and bf16 partitions per param group: swapped for master remainders, read for the "
             "per-parameter states", ("coat_ds.master_partitions", "coat_ds.full_optimizer_state"),
             (REMAINDERS, ZERO_STAGES)),
    Internal(("fp32_partitioned_groups_flat", "fp16_partitioned_groups_flat", "_set_fp32_optimizer_param_groups",
              "_clear_fp32_optimizer_param_groups"),
             "DeepSpeedZeroOptimizer_Stage3", "its master and bf16 sub-group partitions, as for ZeRO-1/2",
             ("coat_ds.master_partitions", "coat_ds.full_optimizer_state"), (REMAINDERS, ZERO_STAGES)),
    Internal(("zero_optimization_stage", "zero_elastic_checkpoint", "zero_offload_optimizer", "bfloat16_enabled",
              "bf16_master_weights_and_gradients", "basic_optimizer", "get_data_types", "load_universal_checkpoint"),
             "DeepSpeedEngine", "the modes refused for CoatFP8AdamW (and CoatFP8Muon), and the optimizer DeepSpeed "
             "built from the config", ("coat_ds.deepspeed_plugin", "coat_ds.engine_hooks"),
             (CHECKPOINTS, REMAINDERS, ZERO_STAGES, MUON_ZERO)),
    Internal(("use_muon",), "a model parameter: DeepSpeed's Muon tag (deepspeed.initialize sets it for \"type\": "
             "\"Muon\" only), which ZeRO-1/2 reads to run Muon on a param group and to copy its cut matrices whole",
             "coat_ds.muon_zero writes it from CoatFP8Muon's param groups before ZeRO-1/2 is built",
             ("coat_ds.muon_zero",), (MUON_ZERO,)),
    Internal(("all_grad_tensors", "optimizer"), "DeepSpeedZeroOptimizer (ZeRO-1/2)",
             "the gradients whose dtype DeepSpeed gives the Muon momentum it stages; its optimizer (the CoatFP8Muon "
             "whose state holds the momentum; written for the duration of average_tensor)",
             ("coat_ds.muon_zero",), (MUON_ZERO,)),
    Internal(("DEEPSPEED_OPTIMIZERS",), "deepspeed.runtime.config", "the optimizer types DeepSpeed builds itself",
             ("coat_ds.engine_hooks",), (MISSPELT_TYPE,)),
    Internal(("single_partition_of_fp32_groups", "base_optimizer_state", "fp32_flat_groups", "optimizer_state_dict",
              "optim_states.pt", "parse_arguments", "argv"),
             "ZeRO checkpoints (the master partitions and optimizer state of each *optim_states.pt shard) and "
             "deepspeed.checkpoint.ds_to_universal (its parse_arguments() reads sys.argv)",
             "coat_ds.to_universal dequantizes the shards and runs DeepSpeed's converter", ("coat_ds.to_universal",),
             (CHECKPOINTS, REMAINDERS)),
)

_applied: dict[tuple[PatchSite, str], object] = {}  # (site, owner) -> what this module put there


def resolve(owner: str):
    """The module, or the class, that "module" or "module:Class" names."""
    module_name, _, class_name = owner.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, class_name) if class_name else module


def is_applied(site: PatchSite) -> bool:
    """Whether the module- or class-level patch of `site` is in place on every owner it names (also under another
    library's functools.wraps wrapper)."""
    return all((site, owner) in _applied
               and _holds(getattr(resolve(owner), site.attribute, None), _applied[(site, owner)])
               for owner in site.owners)


def _holds(current, ours) -> bool:
    """Whether `current` is `ours` or wraps it (its __wrapped__ chain)."""
    while current is not None:
        if current is ours:
            return True
        current = getattr(current, "__wrapped__", None)
    return False


def set_value(site: PatchSite, value) -> None:
    """owner.attribute = value (idempotent); an attribute already holding something else is an error."""
    owner, = site.owners
    existing = getattr(resolve(owner), site.attribute, None)
    if existing is not None and existing is not value:
        raise RuntimeError(f"{owner}.{site.attribute} is already {existing!r}; not replacing it")
    _put(site, owner, value)


def append_member(site: PatchSite, value) -> None:
    """value appended to the list owner.attribute, once."""
    owner, = site.owners
    members = getattr(resolve(owner), site.attribute)
    if value not in members:
        members.append(value)


def wrap(site: PatchSite, make_wrapper: Callable[[Callable], Callable]) -> None:
    """Idempotent: owner.attribute = make_wrapper(original) on every owner of the site (one wrapper, made around
    the first owner's original)."""
    if is_applied(site):
        return
    original = getattr(resolve(site.owners[0]), site.attribute)
    wrapper = functools.wraps(original)(make_wrapper(original))
    for owner in site.owners:
        _put(site, owner, wrapper)


def wrap_instance(site: PatchSite, instance, make_wrapper: Callable[[Callable], Callable]) -> None:
    """instance.attribute = make_wrapper(the instance's bound original), for this instance only."""
    if not isinstance(instance, tuple(resolve(owner) for owner in site.owners)):
        raise TypeError(f"{site.attribute} is patched on instances of {site.owners}, got {type(instance).__name__}")
    original = getattr(instance, site.attribute)
    setattr(instance, site.attribute, functools.wraps(original)(make_wrapper(original)))


def _put(site: PatchSite, owner: str, value) -> None:
    setattr(resolve(owner), site.attribute, value)
    _applied[(site, owner)] = value
