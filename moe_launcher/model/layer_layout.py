"""Which decoder layers each pipeline stage builds, checked before and after megatron builds them.

NVIDIA/Megatron-LM#1778: with --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers
megatron computes the middle-stage layer count as `num_layers - first - last` over
`pipeline_size - 2` stages. When either goes to zero or below, its own checks pass anyway
(`bool(-1)` is true, `x % -1 == 0` always), so it silently builds a different number of layers
than --num-layers (PP=1 N=20 first=5 last=5 builds 5; PP=3 N=4 first=3 last=3 builds layers 2-3
twice). Two guards here:

* `validate_layer_layout` refuses such flags before megatron validates its arguments;
* the layer census (`census_of_model`, `check_census`) counts what was actually built on every
  pipeline rank and refuses a model whose layers differ from what the flags asked for; the
  `layer-census` patch (built_model.py) runs it once on the model megatron built.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from moe_launcher.runtime import collectives
from moe_launcher.runtime.refusals import LayerLayoutError

UPSTREAM = "NVIDIA/Megatron-LM#1778"
FIRST_FLAG = "--decoder-first-pipeline-num-layers"
LAST_FLAG = "--decoder-last-pipeline-num-layers"


@dataclasses.dataclass(frozen=True)
class LayerLayout:
    num_layers: int
    pipeline_parallel: int
    virtual_pipeline: int | None
    first_stage_layers: int | None
    last_stage_layers: int | None

    @classmethod
    def from_args(cls, args) -> LayerLayout | None:
        """The layout the flags ask for, or None where megatron places layers by other rules.

        Runs before megatron's validate_args, so the virtual pipeline size is derived here the
        way megatron will derive it. A custom --pipeline-model-parallel-layout, a hybrid layer
        pattern and the account-for-embedding/loss splits are left to megatron's own checks:
        they do not go through the first/last arithmetic this module guards.
        """
        if (getattr(args, "pipeline_model_parallel_layout", None) is not None
                or getattr(args, "hybrid_layer_pattern", None) is not None
                or getattr(args, "account_for_embedding_in_pipeline_split", False)
                or getattr(args, "account_for_loss_in_pipeline_split", False)
                or args.num_layers is None):
            return None
        pp = args.pipeline_model_parallel_size
        vpp = getattr(args, "num_virtual_stages_per_pipeline_rank", None)
        per_virtual_stage = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
        if vpp is None and per_virtual_stage is not None:
            if args.num_layers % pp or (args.num_layers // pp) % per_virtual_stage:
                return None  # megatron's own divisibility assertions name these flags
            vpp = args.num_layers // pp // per_virtual_stage
        if vpp is None:
            vpp = getattr(args, "virtual_pipeline_model_parallel_size", None)
        return cls(
            num_layers=args.num_layers,
            pipeline_parallel=pp,
            virtual_pipeline=vpp if vpp and vpp > 1 else None,
            first_stage_layers=args.decoder_first_pipeline_num_layers,
            last_stage_layers=args.decoder_last_pipeline_num_layers,
        )

    def flags(self) -> str:
        parts = [f"--num-layers={self.num_layers}",
                 f"--pipeline-model-parallel-size={self.pipeline_parallel}"]
        if self.virtual_pipeline is not None:
            parts.append(f"(virtual pipeline size {self.virtual_pipeline})")
        if self.first_stage_layers is not None:
            parts.append(f"{FIRST_FLAG}={self.first_stage_layers}")
        if self.last_stage_layers is not None:
            parts.append(f"{LAST_FLAG}={self.last_stage_layers}")
        return " ".join(parts)


def validate_layer_layout(layout: LayerLayout) -> list[int]:
    """Decoder layers per pipeline stage; raises LayerLayoutError where megatron would misplace."""
    n, pp, vpp = layout.num_layers, layout.pipeline_parallel, layout.virtual_pipeline
    first, last = layout.first_stage_layers, layout.last_stage_layers

    def refuse(problem: str, fix: str) -> LayerLayoutError:
        return LayerLayoutError(f"{layout.flags()}: {problem} ({UPSTREAM}). Fix: {fix}")

    if n < 1 or pp < 1:
        raise refuse("need at least one layer and one pipeline stage",
                     "set --num-layers and --pipeline-model-parallel-size to positive values")

    if first is None and last is None:
        if n % pp:
            raise refuse(f"{n} layers do not split evenly over {pp} pipeline stages",
                         f"use a multiple of {pp} layers, or {FIRST_FLAG}/{LAST_FLAG} "
                         "for an uneven split")
        per_stage = [n // pp] * pp
    elif pp == 1:
        for flag, value in ((FIRST_FLAG, first), (LAST_FLAG, last)):
            if value is not None and value != n:
                raise refuse(f"with one pipeline stage {flag}={value} contradicts --num-layers={n}; "
                             f"megatron-core builds {value} layers or fails",
                             f"drop {FIRST_FLAG} and {LAST_FLAG} (one stage holds every layer)")
        return [n]
    else:
        per_stage = _uneven_split(layout, refuse)

    if vpp is not None and pp > 1:
        for stage, layers in enumerate(per_stage):
            if layers % vpp:
                raise refuse(f"pipeline stage {stage} would hold {layers} layers, which do not "
                             f"split into {vpp} virtual stages",
                             f"give every pipeline stage a multiple of {vpp} layers")
    return per_stage


def _uneven_split(layout: LayerLayout, refuse: Callable[[str, str], LayerLayoutError]) -> list[int]:
    n, pp = layout.num_layers, layout.pipeline_parallel
    first, last = layout.first_stage_layers, layout.last_stage_layers
    for flag, value in ((FIRST_FLAG, first), (LAST_FLAG, last)):
        if value is not None and not 1 <= value <= n - 1:
            raise refuse(f"{flag}={value} must be between 1 and {n - 1} so every other stage "
                         "keeps at least one layer",
                         f"pick {flag} in [1, {n - 1}]")
    middle_stages = pp - (first is not None) - (last is not None)
    middle_layers = n - (first or 0) - (last or 0)
    if middle_stages == 0:
        if middle_layers != 0:
            raise refuse(f"with {pp} stages the first and last stage are all there is, but "
                         f"{first} + {last} = {first + last} layers, not {n}",
                         f"make {FIRST_FLAG} + {LAST_FLAG} = {n}")
        return [first, last]
    if middle_layers < middle_stages:
        raise refuse(f"{middle_layers} layers are left for {middle_stages} middle pipeline "
                     "stage(s); megatron-core would build layers twice or not at all",
                     f"leave at least one layer per middle stage: first + last <= "
                     f"{n - middle_stages}")
    if middle_layers % middle_stages:
        raise refuse(f"the {middle_layers} layers left for {middle_stages} middle pipeline "
                     "stages do not split evenly",
                     f"choose first/last so that {n} - first - last is a multiple of "
                     f"{middle_stages}")
    middle = [middle_layers // middle_stages] * middle_stages
    return ([first] if first is not None else []) + middle + ([last] if last is not None else [])


# ---------------------------------------------------------------------------------------------
# Layer census: what megatron actually built.
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LayerCensus:
    """Layers by family. A GPT decoder layer has self-attention and an MLP (dense or MoE); a
    HybridModel layer has one of them (`*` attention, `-` dense MLP, `E` MoE), so the families
    are counted separately, as built."""

    dense: int  # decoder layers with a dense MLP
    moe: int  # decoder layers whose mlp is a MoELayer
    attention: int  # decoder layers with self-attention
    mtp: int  # MTP layer applications per forward (a repeated MTP layer counts each depth)
    per_stage: tuple[int, ...]  # decoder layers per pipeline rank
    mtp_moe: int = 0  # MoE layers run by the MTP applications
    mtp_dense: int = 0  # dense MLPs run by the MTP applications
    mtp_attention: int = 0  # self-attentions run by the MTP applications
    layer_numbers: tuple[int, ...] = ()  # 1-based decoder layer numbers, all stages, sorted

    @property
    def decoder_layers(self) -> int:
        return sum(self.per_stage)

    @property
    def moe_layers_with_mtp(self) -> int:
        return self.moe + self.mtp_moe

    def summary(self) -> str:
        return (f"layers per pipeline stage {self.per_stage}; {self.attention} attention, "
                f"{self.dense} dense MLP, {self.moe} MoE in the decoder; {self.mtp} MTP "
                f"({self.mtp_attention} attention, {self.mtp_dense} dense MLP, {self.mtp_moe} MoE)")


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    # DDP, FSDP and Float16Module all keep the wrapped model in .module.
    while hasattr(chunk, "module") and isinstance(chunk.module, torch.nn.Module):
        chunk = chunk.module
    return chunk


def _families(layers) -> tuple[int, int, int]:
    """(attention, dense MLP, MoE) among `layers`; a slot megatron left empty is an IdentityOp."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.moe.moe_layer import MoELayer
    attention = dense = moe = 0
    for layer in layers:
        attention += not isinstance(getattr(layer, "self_attention", IdentityOp()), IdentityOp)
        mlp = getattr(layer, "mlp", IdentityOp())
        moe += isinstance(mlp, MoELayer)
        dense += not isinstance(mlp, (MoELayer, IdentityOp))
    return attention, dense, moe


def _local_counts(model_chunks) -> dict:
    counts = {"numbers": [], "attention": 0, "dense": 0, "moe": 0,
              "mtp": 0, "mtp_attention": 0, "mtp_dense": 0, "mtp_moe": 0}
    for chunk in model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]:
        model = unwrap(chunk)
        layers = list(getattr(getattr(model, "decoder", None), "layers", []))
        counts["numbers"] += [layer.layer_number for layer in layers]
        for key, value in zip(("attention", "dense", "moe"), _families(layers)):
            counts[key] += value
        block = getattr(model, "mtp", None) if getattr(model, "mtp_process", False) else None
        if block is not None:
            depths = model.config.mtp_num_layers
            repeated = getattr(block, "mtp_use_repeated_layer", False)
            for layer in block.layers:
                applications = depths if repeated else 1
                inner = layer.mtp_model_layer
                # A GPT MTP layer is one transformer layer; a hybrid one is a stack of them.
                inner_layers = list(getattr(inner, "layers", [inner]))
                counts["mtp"] += applications
                for key, value in zip(("mtp_attention", "mtp_dense", "mtp_moe"),
                                      _families(inner_layers)):
                    counts[key] += applications * value
    return counts


def census_of_model(model_chunks, pp_group=None) -> LayerCensus:
    """Counts the decoder and MTP layers built on every pipeline rank, by family.

    Each rank counts its own model chunks; the counts are gathered over the pipeline group so
    every rank sees the whole model. Without torch.distributed the local counts are the model.
    """
    if collectives.distributed() and pp_group is None:
        from megatron.core import parallel_state
        pp_group = parallel_state.get_pipeline_model_parallel_group()
    stages = collectives.gather_objects(_local_counts(model_chunks), group=pp_group)

    def total(key):
        return sum(stage[key] for stage in stages)

    return LayerCensus(
        dense=total("dense"), moe=total("moe"), attention=total("attention"), mtp=total("mtp"),
        per_stage=tuple(len(stage["numbers"]) for stage in stages),
        mtp_moe=total("mtp_moe"), mtp_dense=total("mtp_dense"),
        mtp_attention=total("mtp_attention"),
        layer_numbers=tuple(sorted(n for stage in stages for n in stage["numbers"])),
    )


def expected_moe_layers(num_layers: int, num_experts: int | None, moe_layer_freq) -> int:
    """MoE decoder layers the flags ask for (megatron's --moe-layer-freq semantics)."""
    if not num_experts:
        return 0
    if isinstance(moe_layer_freq, int):
        return sum(1 for i in range(num_layers) if i % moe_layer_freq == 0)
    return sum(moe_layer_freq)


def check_census(census: LayerCensus, *, num_layers: int, num_experts: int | None,
                 moe_layer_freq=1, mtp_num_layers: int | None = None) -> None:
    """Raises LayerLayoutError when the built model is not the model the flags describe."""
    problems = []
    if census.layer_numbers != tuple(range(1, num_layers + 1)):
        seen = census.layer_numbers
        twice = sorted({n for n in seen if seen.count(n) > 1})
        missing = sorted(set(range(1, num_layers + 1)) - set(seen))
        problems.append(f"{len(seen)} decoder layers built for --num-layers={num_layers}"
                        + (f", layers {twice} built twice" if twice else "")
                        + (f", layers {missing} missing" if missing else ""))
    want_moe = expected_moe_layers(num_layers, num_experts, moe_layer_freq)
    if census.moe != want_moe:
        problems.append(f"{census.moe} MoE layers built, --moe-layer-freq asks for {want_moe}")
    if census.mtp != (mtp_num_layers or 0):
        problems.append(f"{census.mtp} MTP layers built, --mtp-num-layers={mtp_num_layers}")
    if problems:
        raise LayerLayoutError(
            f"megatron-core built a different model than the flags ask for ({UPSTREAM}): "
            + "; ".join(problems) + f". Built: {census.summary()}. Fix: check "
            f"{FIRST_FLAG}/{LAST_FLAG} and --pipeline-model-parallel-layout against --num-layers.")


def census_of_pattern(pattern: str) -> LayerCensus:
    """The layers --hybrid-layer-pattern asks for: the main pattern's families, each `|`
    segment one pipeline stage, and the MTP pattern once per depth (megatron's parser)."""
    from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols, parse_hybrid_pattern

    parsed = parse_hybrid_pattern(pattern)
    main = parsed.main_pattern or ""
    layers = main.replace(Symbols.PIPE, "")
    mtp = (parsed.mtp_pattern or "") * parsed.mtp_num_depths
    # Layers with a self_attention module, as the census of the built model counts them.
    with_attention = (Symbols.ATTENTION, Symbols.MLA, Symbols.DS_ATTENTION, Symbols.GDN)
    return LayerCensus(
        attention=sum(layers.count(symbol) for symbol in with_attention),
        dense=layers.count(Symbols.MLP),
        moe=layers.count(Symbols.MOE), mtp=parsed.mtp_num_depths,
        per_stage=tuple(len(segment) for segment in main.split(Symbols.PIPE)),
        mtp_attention=sum(mtp.count(symbol) for symbol in with_attention),
        mtp_dense=mtp.count(Symbols.MLP),
        mtp_moe=mtp.count(Symbols.MOE), layer_numbers=tuple(range(1, len(layers) + 1)))


def check_hybrid_census(census: LayerCensus, pattern: str, pipeline: int) -> None:
    """Raises LayerLayoutError when the HybridModel built is not --hybrid-layer-pattern."""
    want = census_of_pattern(pattern)
    fields = ["attention", "dense", "moe", "mtp", "mtp_attention", "mtp_dense", "mtp_moe",
              "layer_numbers"]
    # One segment per pipeline rank: each stage builds its segment. With virtual stages a rank
    # builds several segments; the totals above still hold.
    if len(want.per_stage) == pipeline:
        fields.append("per_stage")
    problems = [f"{field.replace('_', ' ')}: built {getattr(census, field)}, the pattern has "
                f"{getattr(want, field)}" for field in fields
                if getattr(census, field) != getattr(want, field)]
    if problems:
        raise LayerLayoutError(
            f"megatron-core built a different model than --hybrid-layer-pattern={pattern!r} "
            f"asks for: " + "; ".join(problems) + f". Built: {census.summary()}.")
