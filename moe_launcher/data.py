"""Train/valid/test datasets for megatron's pretrain(): mock data or real indexed datasets."""

import os
import struct

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.training import get_args, get_tokenizer, print_rank_0
from megatron.training.utils.common_utils import get_blend_and_blend_per_split

from moe_launcher import dataset_record
from moe_launcher.runtime import collectives
from moe_launcher.runtime.refusals import DataRefusal


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
    if not args.mock_data:
        _check_records(args)
    dataset_class = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"> building {dataset_class.__name__} train/valid/test datasets")
    built = BlendedMegatronDatasetBuilder(
        dataset_class, train_valid_test_num_samples, lambda: True, _dataset_config(args)
    ).build()
    if args.mock_data:
        return built
    return tuple(None if dataset is None else SamplesNamed(dataset) for dataset in built)


# The keys SamplesNamed adds to each sample; the forward step pops them off the host batch.
SOURCE_DATASET, SOURCE_SAMPLE = "source_dataset", "source_sample"


class SamplesNamed(torch.utils.data.Dataset):
    """megatron's GPTDataset or BlendedDataset, each sample also naming where it comes from:
    the indexed dataset's path prefix and the sample's index in that GPTDataset, so that a batch
    the model cannot take is named (moe_launcher/gpt_step.py). Wrapped after megatron built it:
    its index caches keep their names. Everything else is the wrapped dataset's."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name):
        if name == "dataset":  # not set yet (unpickling in a DataLoader worker)
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitem__(self, idx):
        sample = self.dataset[idx]
        inner, index = self.dataset, idx
        if "dataset_id" in sample:  # a blend: which of its datasets, and where in it
            inner = self.dataset.datasets[int(sample["dataset_id"])]
            index = self.dataset.dataset_sample_index[idx]
        sample[SOURCE_DATASET] = str(inner.dataset_path)
        sample[SOURCE_SAMPLE] = -1 if index is None else int(index)
        return sample


def _check_records(args) -> None:
    """The datasets' prepare_data records against the tokenizer megatron built and the model's
    vocabulary (moe_launcher/dataset_record.py), before any is built: rank 0 reads them (a blend
    of many datasets on thousands of ranks would otherwise open every record on every rank),
    every rank gets its verdict. megatron's dataset builder is collective too: every rank calls
    this provider."""
    verdict = (dataset_record.judge(datasets_read(args), get_tokenizer(), args.tokenizer_type,
                                    args.padded_vocab_size)
               if collectives.rank() == 0 else None)
    refusal, note = collectives.gather_objects(verdict)[0]
    if refusal:
        raise DataRefusal(refusal, every_rank=True)
    if note:
        print_rank_0(f"[pretrain_moe] data: {note}")


# Each rank builds its own dataset and loader, so batches need no broadcast (see gpt_step).
train_valid_test_datasets.is_distributed = True


_SPLIT_FLAGS = ("--train-data-path", "--valid-data-path", "--test-data-path")


def datasets_read(args) -> list[tuple[str, str]]:
    """(flag, prefix) for every dataset the run reads, as megatron's own
    get_blend_and_blend_per_split resolves them: --data-path blends, the per-split paths, and the
    files --data-args-path and --per-split-data-args-path name (read here, as megatron does)."""
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    found = []
    if blend is not None:
        flag = "--data-args-path" if getattr(args, "data_args_path", None) else "--data-path"
        found += [(flag, prefix) for prefix in blend[0]]
    for split_flag, split in zip(_SPLIT_FLAGS, blend_per_split or ()):
        if split is not None:
            flag = ("--per-split-data-args-path"
                    if getattr(args, "per_split_data_args_path", None) else split_flag)
            found += [(flag, prefix) for prefix in split[0]]
    return found


# megatron's .idx: MMIDIDX header (9 bytes), version <Q, token dtype code <B, sequence count <Q,
# document count <Q (34 bytes), then int32 sequence lengths, int64 sequence pointers (byte offsets
# into the .bin), int64 document indices (and, for multimodal data, one mode byte per sequence).
_IDX_HEAD = 34


def index_problem(prefix: str) -> str | None:
    """What makes `prefix`.idx unreadable, or inconsistent with `prefix`.bin; None when it is
    neither. Three small reads whatever the dataset's size: the header, the length its counts
    imply, and the last sequence's end within the .bin (a partial copy cuts the .bin's tail,
    which megatron reads only when a sample reaches it, hours or days into a run)."""
    from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType

    idx, bin_path = prefix + ".idx", prefix + ".bin"
    idx_size, bin_size = os.path.getsize(idx), os.path.getsize(bin_path)
    with open(idx, "rb") as f:
        head = f.read(_IDX_HEAD)
        if len(head) < _IDX_HEAD or head[:9] != _INDEX_HEADER:
            return f"{idx} is not an indexed dataset's index (no MMIDIDX header)"
        version, code, sequences, documents = struct.unpack("<QBQQ", head[9:])
        if version != 1:
            return f"{idx} is index version {version}; megatron reads version 1"
        try:
            itemsize = DType.size(DType.dtype_from_code(code))
        except (ValueError, KeyError):
            return f"{idx} names token type code {code}, which megatron does not know"
        needed = _IDX_HEAD + sequences * (4 + 8) + documents * 8
        if idx_size < needed:
            return (f"{idx} is {idx_size} bytes, but its counts ({sequences} sequences, "
                    f"{documents} documents) need {needed}: it is truncated")
        if not sequences:
            return None
        f.seek(_IDX_HEAD + (sequences - 1) * 4)
        (last_length,) = struct.unpack("<i", f.read(4))
        f.seek(_IDX_HEAD + sequences * 4 + (sequences - 1) * 8)
        (last_pointer,) = struct.unpack("<q", f.read(8))
    end = last_pointer + last_length * itemsize
    if end > bin_size:
        return (f"{bin_path} is {bin_size} bytes, but {idx} ends its last sequence at byte {end}: "
                f"the .bin is truncated (a partial copy?)")
    return None
