"""GPT pretraining on megatron.training with `--transformer-impl coat` (and the stock `transformer_engine` / `local`).

    python -m coat_megatron.pretrain_gpt --transformer-impl coat [Megatron options] [--coat-* options]

One launcher for every arm, so data, loss, seed and logging are identical: only the layer spec differs.
`--coat-optimizer` (any spec) makes the inner Adam of Megatron's optimizer CoatFP8AdamW (coat_megatron.optimizer);
every run ends by printing each rank's optimizer-state bytes and peak memory.
`transformer_engine` and `local` use Megatron's own spec choice; `coat` uses coat_megatron's decoder-block spec.
Data: `--mock-data`, or Megatron indexed datasets (`--data-path` / per-split paths) through megatron.core.datasets.
Needs megatron.training (in the megatron-core wheel from 0.17.0 on, which requires Python >= 3.12; or a
Megatron-LM checkout on PYTHONPATH) and CUDA.
"""
from __future__ import annotations

import dataclasses
import inspect
import sys
from functools import partial

import torch

from .arguments import COAT_IMPL, validate_coat_args


MEGATRON_TRAINING_PYTHON = (3, 12)  # megatron-core ships megatron.training from 0.17.0 on, and requires Python 3.12


def missing_megatron_training_message(error: str, core_version: str, python: tuple[int, int]) -> str:
    """What to install when `import megatron.training` fails, for this Python and megatron-core."""
    if python >= MEGATRON_TRAINING_PYTHON:
        install = "pip install 'megatron-core>=0.17' (0.17.0 is the first wheel that ships megatron.training)"
    else:
        install = (f"megatron-core 0.17.0 is the first wheel that ships megatron.training and it, like every later "
                   f"release, requires Python >= {MEGATRON_TRAINING_PYTHON[0]}.{MEGATRON_TRAINING_PYTHON[1]} "
                   f"(this is Python {python[0]}.{python[1]}): use Python 3.12 with pip install "
                   "'megatron-core>=0.17'")
    return (f"coat_megatron.pretrain_gpt needs megatron.training, which is missing ({error}); megatron-core "
            f"{core_version} is installed. {install}, or put a Megatron-LM checkout of the tag matching your "
            "megatron-core (e.g. core_v0.16.1) on PYTHONPATH. megatron.training also needs CUDA. Without it, the COAT "
            "layer specs (coat_megatron.get_gpt_decoder_block_coat_spec) work in your own training loop, on CPU "
            "too: docs/megatron.md, 'Your own training loop'.")


def _require_megatron_training():
    try:
        import megatron.training  # noqa: F401
    except ImportError as exc:
        try:
            from megatron.core import __version__ as core_version
        except ImportError:
            core_version = "not installed"
        raise SystemExit(missing_megatron_training_message(str(exc), core_version, sys.version_info[:2])) from exc


# ---- data -------------------------------------------------------------------------------------------------------
def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Mock or indexed GPT datasets, built on every rank (each TP rank reads its own copy of the same batch)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer
    from megatron.training.utils import get_blend_and_blend_per_split

    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    wanted = dict(random_seed=args.seed, sequence_length=args.seq_length, blend=blend,
                  blend_per_split=blend_per_split, split=args.split, path_to_cache=args.data_cache_path,
                  tokenizer=get_tokenizer(), reset_position_ids=args.reset_position_ids,
                  reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
                  create_attention_mask=args.create_attention_mask_in_dataloader,
                  num_dataset_builder_threads=getattr(args, "num_dataset_builder_threads", 1),
                  mid_level_dataset_surplus=getattr(args, "mid_level_dataset_surplus", 0.005),
                  mmap_bin_files=getattr(args, "mmap_bin_files", True))
    fields = {f.name for f in dataclasses.fields(GPTDatasetConfig) if f.init}
    config = GPTDatasetConfig(**{k: v for k, v in wanted.items() if k in fields})
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    return BlendedMegatronDatasetBuilder(dataset_type, train_val_test_num_samples, lambda: True, config).build()


train_valid_test_datasets_provider.is_distributed = True  # megatron.training: call the provider on every rank


def loss_func(loss_mask, output_tensor, model=None):
    """Summed token loss and token count: Megatron divides by the global token count."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    from megatron.training import get_args

    if get_args().context_parallel_size > 1:
        raise NotImplementedError("coat_megatron.pretrain_gpt: context parallelism is not wired in this launcher")
    batch = next(data_iterator)
    device = torch.cuda.current_device()
    tokens, labels, loss_mask, position_ids = (batch[k].to(device, non_blocking=True)
                                               for k in ("tokens", "labels", "loss_mask", "position_ids"))
    attention_mask = batch.get("attention_mask")
    if attention_mask is not None:
        attention_mask = attention_mask.to(device, non_blocking=True)
    output = model(tokens, position_ids, attention_mask, labels=labels)
    return output, partial(loss_func, loss_mask)


# ---- model ------------------------------------------------------------------------------------------------------
def coat_block_spec(config, vp_stage=None):
    from megatron.training import get_args

    from .enable import enable_coat

    return enable_coat().decoder_block_spec(config, get_args(), vp_stage=vp_stage)


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """GPTModel for the pretrain() APIs that take a model provider (megatron-core 0.16 checkouts, 0.17, 0.18)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    validate_coat_args(args)
    config = config if config is not None else core_transformer_config_from_args(args)
    if args.transformer_impl == COAT_IMPL:
        spec = coat_block_spec(config, vp_stage)
    elif args.transformer_impl == "transformer_engine":
        spec = get_gpt_layer_with_transformer_engine_spec(args.num_experts, args.moe_grouped_gemm, args.qk_layernorm)
    else:
        spec = get_gpt_layer_local_spec(args.num_experts, args.moe_grouped_gemm, args.qk_layernorm,
                                        normalization=args.normalization)
    kwargs = dict(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                  max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
                  post_process=post_process, fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
                  parallel_output=True,
                  share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                  position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                  rotary_base=args.rotary_base, vp_stage=vp_stage, pg_collection=pg_collection)
    accepted = inspect.signature(GPTModel.__init__).parameters
    return GPTModel(**{k: v for k, v in kwargs.items() if k in accepted})


# ---- entry ------------------------------------------------------------------------------------------------------
ARGS_DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}


def _use_prebuilt_dataset_helpers():
    """megatron.training runs `make` in megatron/core/datasets at start-up and exits when it fails; the wheels
    ship the compiled helpers (helpers_cpp) but not the Makefile. Skip the build when they import."""
    try:
        import megatron.core.datasets.helpers_cpp  # noqa: F401
    except ImportError:
        return
    import megatron.core.datasets.utils as dataset_utils

    dataset_utils.compile_helpers = lambda: None


def main():
    _require_megatron_training()
    from megatron.core.enums import ModelType
    from megatron.training import pretrain

    from .enable import enable_coat

    handle = enable_coat()
    _use_prebuilt_dataset_helpers()

    params = list(inspect.signature(pretrain).parameters)
    if params[0] != "cfg_container":  # 0.16 checkout / 0.17: pretrain parses the arguments itself
        pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
                 args_defaults=ARGS_DEFAULTS)
        _report_memory(handle)
        return
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    args = parse_and_validate_args(args_defaults=ARGS_DEFAULTS)
    validate_coat_args(args)
    if params.index("model_provider") > 3:  # 0.19+: the model is described by a ModelConfig with a builder
        from megatron.training.argument_utils import gpt_config_from_args

        model_cfg = gpt_config_from_args(args)
        if args.transformer_impl == COAT_IMPL:
            model_cfg.transformer_layer_spec = _coat_spec_for_model_config
        pretrain(pretrain_cfg_container_from_args(args, model_cfg), train_valid_test_datasets_provider,
                 ModelType.encoder_or_decoder, forward_step)
    else:  # 0.18: pretrain(cfg, datasets, model_provider, model_type, forward_step)
        pretrain(pretrain_cfg_container_from_args(args), train_valid_test_datasets_provider, model_provider,
                 ModelType.encoder_or_decoder, forward_step)
    _report_memory(handle)


def _coat_spec_for_model_config(model_config, vp_stage=None):
    return coat_block_spec(model_config.transformer, vp_stage)


def _report_memory(handle):
    from .optimizer import optimizer_state_report

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    for optimizer in handle.optimizers:
        r = optimizer_state_report(optimizer)
        print(f"[coat_megatron] rank {rank} optimizer state: {r['optimizer']} {r['state_bytes'] / 2**20:.1f} MiB "
              f"for {r['stepped_numel'] / 1e6:.2f}M elements ({r['bytes_per_element']:.3f} B/element)", flush=True)
    if torch.cuda.is_available():
        print(f"[coat_megatron] rank {rank} peak memory allocated: "
              f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB", flush=True)
        # what stays allocated between iterations (parameters, gradient buffers, optimizer state, FP8 weight
        # copies, graph pools), and the card's size: with the peak, this predicts the largest micro-batch
        card = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        print(f"[coat_megatron] rank {rank} memory allocated after training: "
              f"{torch.cuda.memory_allocated() / 2**30:.2f} GiB of {card / 2**30:.2f} GiB", flush=True)


if __name__ == "__main__":
    sys.exit(main())
