"""Train/valid/test datasets for megatron's pretrain(): mock data or real indexed datasets."""

import os

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.training import get_args, get_tokenizer, print_rank_0
from megatron.training.utils.common_utils import get_blend_and_blend_per_split


def _dataset_config(args) -> GPTDatasetConfig:
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
    )


def train_valid_test_datasets(train_valid_test_num_samples, vp_stage=None):
    args = get_args()
    dataset_class = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"> building {dataset_class.__name__} train/valid/test datasets")
    return BlendedMegatronDatasetBuilder(
        dataset_class, train_valid_test_num_samples, lambda: True, _dataset_config(args)
    ).build()


# Each rank builds its own dataset and loader, so batches need no broadcast (see gpt_step).
train_valid_test_datasets.is_distributed = True


def missing_data_paths(data_path: list[str] | None) -> list[str]:
    """The --data-path prefixes (weights skipped) whose .bin/.idx files do not exist."""
    prefixes = [p for p in (data_path or []) if not _is_number(p)]
    return [p for p in prefixes
            if not (os.path.exists(p + ".bin") and os.path.exists(p + ".idx"))]


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False
